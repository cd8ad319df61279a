"""Signing-key rotation end to end: enrolled devices follow the endorsement chain, refuse
keys nobody they trust endorsed, and stop accepting the old key after the overlap."""

from __future__ import annotations

import datetime as dt
import time

import boto3
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from contract import errors
from contract.assignment import AssignmentRejected, key_id_of, new_nonce, verify_sync
from contract.device_client import DeviceCallError
from contract.pinned_keys import endorsement_body
from control_plane.app import build_signing_keys
from control_plane.crypto import verify_manifest
from protos import common_pb2, fleet_pb2
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.api.test_replicas import replicas  # noqa: F401 - fixture
from tests.control_plane.helpers import start_control_plane

ANDROID = {"platform": "android"}
HOUR = dt.timedelta(hours=1)


def _roll_out(client, version: int = 1) -> None:
    client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=version))


def test_enrolled_device_follows_a_rotation_until_the_overlap_ends(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    with cp.client() as client:
        _roll_out(client)
        old_id = client.get_signing_keys()[0].key_id
        # An answer signed by the old key, kept to be checked after the overlap.
        nonce = new_nonce()
        old_answer = device.sync_raw(nonce=nonce)
        assert old_answer.signing_key_id == old_id
        rotated = client.rotate_signing_key(overlap_s=3600)
        chain = client.get_signing_keys()
    new_id = rotated.active.key_id
    assert rotated.previous.key_id == old_id and rotated.active.endorsed_by == old_id
    assert [k.key_id for k in chain] == [old_id, new_id]
    assert [k.active for k in chain] == [False, True]
    ends = rotated.previous.not_after.ToDatetime(dt.UTC)
    assert HOUR - dt.timedelta(minutes=1) < ends - dt.datetime.now(dt.UTC) <= HOUR

    verified = device.sync()
    assert verified.models["det"].version == 1
    answer = device.sync_raw()
    assert answer.signing_key_id == new_id
    m = answer.models[0]  # re-signed at rotation, and not served stale from a cache
    verify_manifest(m.manifest, m.manifest_signature, rotated.active.public_key_pem)
    assert cp.registry.store.get_version("det", 1).signing_key_id == new_id
    assert {k.key_id for k in device.ring.keys} == {old_id, new_id}

    now = dt.datetime.now(dt.UTC)
    check = dict(device_id=device.id, nonce=nonce, last_revision=0)
    verify_sync(old_answer, keys=device.ring.valid_keys(now), now=now, **check)
    after = ends + dt.timedelta(seconds=1)
    with pytest.raises(AssignmentRejected, match="does not verify under any pinned key"):
        verify_sync(old_answer, keys=device.ring.valid_keys(after), now=after, **check)
    # A Sync after the overlap still verifies (new key) and the old key is forgotten.
    assert device.sync(now=after).models["det"].version == 1
    assert {k.key_id for k in device.ring.keys} == {new_id}


def test_a_key_endorsed_by_nobody_trusted_is_refused(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    with cp.client() as client:
        _roll_out(client)
    trusted = {k.key_id for k in device.ring.keys}
    attacker = Ed25519PrivateKey.generate()
    pem = attacker.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    forged_id = key_id_of(attacker.public_key())
    now = dt.datetime.now(dt.UTC).replace(microsecond=0)
    old_id = next(iter(trusted))
    statement = endorsement_body(
        key_id=forged_id,
        public_key_pem=pem,
        created_at=now,
        endorsed_by=old_id,
        endorser_not_after=now,
    )

    def inject(signed_by_self: bool):
        def tamper(response):
            response.signing_keys.append(
                common_pb2.SigningKey(
                    key_id=forged_id,
                    public_key_pem=pem,
                    endorsement=statement,
                    # Claims the trusted key endorsed it; signed by the attacker (or by
                    # nobody) instead.
                    endorsement_signature=attacker.sign(statement) if signed_by_self else b"",
                    endorsed_by=old_id,
                    active=True,
                )
            )
            response.document_signature = attacker.sign(response.document)
            response.signing_key_id = forged_id

        return tamper

    for signed_by_self in (True, False):
        with pytest.raises(AssignmentRejected, match="does not verify under any pinned key"):
            device.sync(tamper=inject(signed_by_self))
        assert {k.key_id for k in device.ring.keys} == trusted
        # Nor did the forged endorsement end the trusted key early.
        assert all(k.not_after is None for k in device.ring.keys)
    assert device.sync().models["det"].version == 1


def test_device_enrolled_after_rotations_pins_the_valid_keys(published, enroll_token):
    cp = published
    with cp.client() as client:
        first = client.rotate_signing_key(overlap_s=60)
        second = client.rotate_signing_key(overlap_s=60)
        _roll_out(client, version=2)
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    ids = [first.previous.key_id, first.active.key_id, second.active.key_id]
    assert {k.key_id for k in device.ring.keys} == set(ids)
    assert len(device.signing_keys) == 3  # all still within their overlap
    assert device.sync().models["det"].version == 2
    assert device.sync_raw().signing_key_id == ids[-1]
    for version in (1, 2):
        assert cp.registry.store.get_version("det", version).signing_key_id == ids[-1]


def test_rotation_refuses_bad_requests_and_keeps_the_active_key(cp):
    with cp.client() as client:
        before = client.get_signing_keys()
        for bad in ("aws-kms://key?endpoint_url=http://evil", "gcp-kms://x", "aws-kms://"):
            with pytest.raises(errors.InvalidArgument):
                client.rotate_signing_key(bad)
        with pytest.raises(errors.InvalidArgument, match="negative"):
            client.rotate_signing_key(overlap_s=-1)
        assert client.get_signing_keys() == before
    assert sorted(p.name for p in (cp.config.home / "keys").glob("signing_*.pem")) == [
        "signing_ed25519.pem"
    ]


@pytest.mark.parametrize("token", ["", "skf_wrong"])
def test_signing_key_calls_need_a_token(cp, token):
    with cp.client(token) as client:
        for call in (client.get_signing_keys, client.rotate_signing_key):
            with pytest.raises(errors.Unauthenticated):
                call()
    assert len(cp.registry.signer.chain()) == 1


def test_an_operator_reads_the_chain_as_stored_not_a_replicas_cached_view(cp):
    """GetSigningKeys answers from the database: after a rotation made elsewhere (another
    replica, or another worker of this one), it names the new key at once, while signing
    may follow within REFRESH_S."""
    with cp.client() as client:
        client.get_signing_keys()  # this replica's view is fresh for REFRESH_S from here
    _, active, _ = build_signing_keys(cp.config, cp.registry.store).rotate()
    with cp.client() as client:
        assert client.get_signing_keys()[-1].key_id == active.key_id


@pytest.mark.postgres
def test_replicas_share_the_active_key(replicas, onnx_path):  # noqa: F811 - fixture
    (a, b), (_, address_b) = replicas
    a.push(onnx_path, name="det")
    _roll_out(a)
    device = Device.enroll(address_b, b.create_enrollment_token().token, ANDROID)
    assert device.sync().models["det"].version == 1
    rotated = a.rotate_signing_key()
    deadline = time.monotonic() + 10
    while device.sync_raw().signing_key_id != rotated.active.key_id:
        assert time.monotonic() < deadline, "replica B never signed with the new key"
        time.sleep(0.5)
    assert device.sync().models["det"].version == 1
    assert b.get_signing_keys()[-1].key_id == rotated.active.key_id


def test_rotate_to_a_kms_key(tmp_path, onnx_path, moto_endpoint):
    kms = boto3.client("kms", endpoint_url=moto_endpoint, region_name="us-east-1")
    key = kms.create_key(KeySpec="ECC_NIST_P256", KeyUsage="SIGN_VERIFY")["KeyMetadata"]["KeyId"]
    plane = start_control_plane(
        tmp_path / "home", kms_endpoint=moto_endpoint, kms_region="us-east-1"
    )
    try:
        with plane.client() as client:
            client.push(onnx_path, name="det")
            _roll_out(client)
            device = Device.enroll(plane.address, client.create_enrollment_token().token, ANDROID)
            rotated = client.rotate_signing_key(f"aws-kms://{key}")
            assert b"BEGIN PUBLIC KEY" in rotated.active.public_key_pem
            assert rotated.previous.not_after.ToDatetime(dt.UTC) > dt.datetime.now(dt.UTC)
            pins = plane.pins.update(client.get_signing_keys(), dt.datetime.now(dt.UTC))
            out = tmp_path / "det.mnn"
            client.pull("det", 1, out, pins=pins)
        assert device.sync().models["det"].version == 1
        assert device.sync_raw().signing_key_id == rotated.active.key_id
        version = plane.registry.store.get_version("det", 1)
        assert version.signing_key_id == rotated.active.key_id
        assert (
            pins.verify(version.manifest, version.manifest_signature, dt.datetime.now(dt.UTC))[0]
            == rotated.active.key_id
        )
        # Another replica opens the active key from the shared chain and signs with it.
        replica = build_signing_keys(plane.config, plane.registry.store)
        signed = replica.sign({"n": 1})
        assert signed.key_id == rotated.active.key_id
        verify_manifest(signed.body, signed.signature, rotated.active.public_key_pem)
        assert not list((plane.config.home / "keys").glob("signing_ed25519_*.pem"))
    finally:
        plane.stop()


def test_a_replica_whose_chain_is_stale_still_sends_the_key_that_signed_its_manifests(
    published, enroll_token, monkeypatch
):
    """Another replica (or worker) rotates; this one has not re-read the chain yet.

    The rotation re-signed every manifest in the database, so a version this replica
    reads now is signed by a key its cached chain does not hold: its answer must carry
    that key, or the device refuses the manifest (seen on `--workers 2` replicas).
    """
    from control_plane.registry import signers

    monkeypatch.setattr(signers, "REFRESH_S", 3600.0)  # the chain stays cached: no timing
    cp = published
    with cp.client() as client:
        _roll_out(client)
    other = start_control_plane(cp.config.home, db=cp.config.db)  # caches of its own
    try:
        device = Device.enroll(other.address, enroll_token, ANDROID)  # reads other's chain
        with cp.client() as client:
            rotated = client.rotate_signing_key(overlap_s=3600)
        assert other.registry.signer.chain()[-1].key_id == rotated.previous.key_id  # stale
        # An answer the rotating server signed with the new key, acknowledged here.
        device.address = cp.address
        signed_there = device.sync_raw()
        assert signed_there.signing_key_id == rotated.active.key_id
        device.address = other.address
        device.ack(signed_there)
        assert device.sync().models["det"].version == 1
        assert rotated.active.key_id in {k.key_id for k in device.ring.keys}
        answer = device.sync_raw()
        m = answer.models[0]
        verify_manifest(m.manifest, m.manifest_signature, rotated.active.public_key_pem)
        assert rotated.active.key_id in {k.key_id for k in answer.signing_keys}
    finally:
        other.stop()


def _chain_reads_at_frozen_time(cp, monkeypatch) -> tuple[list[float], list[int]]:
    """Freeze delivery's monotonic clock (now[0] moves it) and count reads of the chain."""
    now = [1000.0]
    monkeypatch.setattr(cp.app.delivery, "_monotonic", lambda: now[0])
    store = cp.registry.signer._store
    reads: list[int] = []
    real = store.signing_keys
    monkeypatch.setattr(store, "signing_keys", lambda: (reads.append(1), real())[1])
    return now, reads


def test_a_manifest_signer_no_chain_holds_costs_one_chain_read_not_one_per_sync(
    published, enroll_token, monkeypatch
):
    """A version whose recorded signer is in no chain (a database restored or edited by
    hand) is looked for once per UNKNOWN_KEY_RECHECK_S, not with every Sync's database read.
    """
    from sqlalchemy import update

    from control_plane.store import orm

    cp = published
    with cp.client() as client:
        _roll_out(client)
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    assert device.sync().models["det"].version == 1
    with cp.registry.store._scope() as session:
        session.execute(update(orm.VersionRow).values(signing_key_id="deadbeefdeadbeef"))
    delivery = cp.app.delivery
    delivery._versions = type(delivery._versions)(16)  # the edited record, read afresh
    now, reads = _chain_reads_at_frozen_time(cp, monkeypatch)
    for _ in range(10):
        device.sync_raw()
    assert len(reads) == 1
    now[0] += 5.1  # past UNKNOWN_KEY_RECHECK_S: looked for once more
    for _ in range(3):
        device.sync_raw()
    assert len(reads) == 2


def test_acks_no_key_verifies_cost_one_chain_read_each_interval(
    published, enroll_token, monkeypatch
):
    """An Ack whose signature no cached key verifies re-reads the chain (another worker
    may have signed it with a key rotated in since), but not for every such Ack."""
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    response = device.sync_raw()
    response.document_signature = bytes(64)  # signed by nobody
    now, reads = _chain_reads_at_frozen_time(cp, monkeypatch)
    for _ in range(10):
        with pytest.raises(DeviceCallError, match="not an assignment this control plane signed"):
            device.ack(response)
    assert len(reads) == 1
