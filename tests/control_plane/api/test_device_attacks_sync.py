"""Attacks through Sync and Download: hostile inputs, replayed or forged answers, artifacts.

Shared fixtures and helpers: _attack_helpers.py.
"""

from __future__ import annotations

import datetime as dt
import time

import grpc
import pytest

from contract.assignment import AssignmentRejected, load_public_keys, verify_sync
from contract.device_client import DeviceCallError
from control_plane.rollouts.lifecycle import bucket, stage_limit
from protos import device_pb2
from tests.control_plane.api._attack_helpers import (
    ANDROID,
    code_of,
    enroll,
    rollout,
    sync_with,
)
from tests.control_plane.api._attack_helpers import fresh as fresh  # fixture
from tests.control_plane.api._attack_helpers import plane as plane  # fixture
from tests.control_plane.api._attack_helpers import run_id as run_id  # fixture
from tests.control_plane.api.device_helpers import Device, run

# -- problems the review confirmed (each failed before its fix) -------------------------------


@pytest.mark.parametrize(
    "installed",
    [
        {"model": "m" * 5000, "version": 1, "variant": "fp32"},
        {"model": "det\x00", "version": 1, "variant": "fp32"},
        {"model": "det", "version": 2**40, "variant": "fp32"},
        {"model": "det", "version": -7, "variant": "fp32"},
        {"model": "det", "version": 1, "variant": "v" * 1000},
    ],
    ids=["long-model", "nul-model", "huge-version", "negative-version", "long-variant"],
)
def test_installed_reports_are_validated(fresh, installed):
    """Sync stores whatever a device reports as installed, unchecked.

    Only the count (256) is limited: model and variant names of any length and content
    (up to the 8 MiB message) and any int64 version are queued for the database. On
    SQLite they are stored as sent (megabytes of junk per Sync); on PostgreSQL they break
    the write-behind batch (see the next test). They should be refused with
    INVALID_ARGUMENT like bad attributes are.
    """
    cp = fresh
    with cp.client() as client:
        token = client.create_enrollment_token().token
    device = Device.enroll(cp.address, token, ANDROID)
    entry = device_pb2.InstalledModel(**installed)
    assert code_of(lambda: sync_with(device, ANDROID, [entry])) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_one_bad_report_does_not_poison_the_write_behind(fresh):
    """On PostgreSQL one device's report can stop all device writes and the operator API.

    A model name longer than VARCHAR(64) (or NUL bytes, or a version past int32) makes
    the batched write fail; `DeviceWriter.flush` puts the whole batch back and retries
    forever, so no device's last_seen/installed/synced is written again; ListDevices,
    GetDevice, GetRollout and TransitionRollout (which flush first) fail with INTERNAL
    from then on, and the server cannot even stop cleanly (its final flush raises).
    A batch should never fail as a whole because of one device's values.
    """
    cp = fresh
    with cp.client() as client:
        token = client.create_enrollment_token().token
    attacker = Device.enroll(cp.address, token, ANDROID)
    victim = Device.enroll(cp.address, token, ANDROID)
    bad = device_pb2.InstalledModel(model="x" * 65, version=1, variant="fp32")
    try:
        sync_with(attacker, ANDROID, [bad])
    except DeviceCallError:
        pass  # refusing the report is one fix
    good = device_pb2.InstalledModel(model="det", version=1, variant="fp32")
    sync_with(victim, ANDROID, [good])
    time.sleep(0.5)  # a few flushes
    with cp.client() as client:
        shown = client.get_device(victim.id)  # INTERNAL while the batch is poisoned
        assert [(m.model, m.version) for m in shown.installed] == [("det", 1)]
        assert len(client.list_devices()) == 2
    cp.app.writer.flush()  # what a clean shutdown does last


def test_download_right_after_the_sync_that_assigned_it(plane, run_id):
    """Download authorizes against stored attributes, which lag Sync's by a flush.

    Sync resolves the device's desired state from the attributes it just reported;
    Download resolves it again from the attributes in the database, written behind
    (every 0.5 s by default). A device that Syncs with new attributes (an app update) and
    downloads what it was just assigned is refused PERMISSION_DENIED, and the agent does
    not retry that code. Conversely a device is still served what it is no longer
    assigned until the flush. Download should check against the same attributes Sync used.
    """
    cp = plane
    device = enroll(cp, run_id, {**ANDROID, "app_version": "5.2"})
    device.sync()
    rollout(cp, run_id, 1, "app_version>=5.3")
    device.attributes = {**device.attributes, "app_version": "5.3"}  # the app was updated
    verified = device.sync()
    assert "det" in verified.models
    device.install(verified, "det")  # PERMISSION_DENIED: "not assigned to this device"


def test_an_older_answer_at_the_same_revision_is_not_accepted_again(plane, run_id, monkeypatch):
    """verify_sync accepts any answer whose revision equals the last accepted one.

    The revision is fleet-wide and does not move when only the device's own attributes
    change, so one device can hold two different signed answers at the same revision: one
    without a model (before an app update) and one with it. Whoever relays the traffic
    (the channel is plaintext until TLS lands; a proxy; a cache) can replay the older
    answer for the assignment's lifetime (24 h) and make the device drop or never get
    its model. Bind each answer to its request (a device nonce signed back) or to a
    per-device sequence, and refuse anything not newer than what was accepted.
    """
    cp = plane
    device = enroll(cp, run_id, {**ANDROID, "app_version": "5.2"})
    rollout(cp, run_id, 1, "app_version>=5.3")
    before = device.sync_raw()  # no model yet
    time.sleep(1.1)  # even issued_at (whole seconds) differs
    device.attributes = {**device.attributes, "app_version": "5.3"}
    assert "det" in device.sync().models
    assert device.revision == before.revision  # nothing changed fleet-wide in between
    monkeypatch.setattr(device, "sync_raw", lambda revision=None, **_: before)  # replayed
    with pytest.raises(AssignmentRejected):
        device.sync()


# -- attacks that are refused today (regression tests) ----------------------------------------


def test_no_artifact_or_key_without_a_current_assignment(plane, run_id):
    cp = plane
    chosen = enroll(cp, run_id, ANDROID)
    other = enroll(cp, run_id, {"platform": "ios"})
    r = rollout(cp, run_id, 2, "platform=android", variant="int8")
    m = chosen.sync().models["det"]
    assert m.wrapped_data_key and (m.version, m.variant) == (2, "int8")
    assert other.sync().models == {}
    denied = grpc.StatusCode.PERMISSION_DENIED
    # Another device's artifact, by digest.
    assert code_of(lambda: other.download(m.ciphertext_sha256, m.ciphertext_size)) == denied
    # The other variant and the other version of the model it is assigned.
    versions = {n: cp.app.delivery.version("det", n) for n in (1, 2)}
    for number, version in versions.items():
        for v in version.variants:
            if (number, v.name) != (2, "int8"):
                got = code_of(lambda v=v: chosen.download(v.ciphertext_sha256, 10))
                assert got == denied, (number, v.name)
    # Junk artifact names are refused like unassigned ones (no oracle, no path tricks).
    for junk in ("", "../" * 20 + "etc/passwd", "Z" * 64, m.ciphertext_sha256.upper(), "0" * 10000):
        assert code_of(lambda j=junk: chosen.download(j, 10)) == denied
    # Offsets: negative refused, the end yields nothing.
    assert (
        code_of(lambda: chosen.download(m.ciphertext_sha256, m.ciphertext_size, offset=-1))
        == grpc.StatusCode.INVALID_ARGUMENT
    )
    tail = run(
        cp.address,
        chosen.credential,
        lambda c: _raw_download(c, m.ciphertext_sha256, m.ciphertext_size),
    )
    assert tail == b""
    # Rolled back: neither key nor bytes any more.
    with cp.client() as client:
        client.transition_rollout(r.id, "rollback", "bad model")
    assert chosen.sync().models == {}
    assert code_of(lambda: chosen.download(m.ciphertext_sha256, m.ciphertext_size)) == denied
    # A paused 1% canary: only the devices in its stage get its key and bytes.
    canary = rollout(cp, run_id, 2, "platform=android", stages=[1, 100])
    with cp.client() as client:
        client.transition_rollout(canary.id, "pause")
    fp32 = cp.app.delivery.version("det", 2).variant("fp32")
    for device in (chosen, *(enroll(cp, run_id, ANDROID) for _ in range(3))):
        inside = bucket(canary.id, device.id) < stage_limit((1.0, 100.0), 0)
        assert ("det" in device.sync().models) == inside
        if not inside:
            got = code_of(lambda d=device: d.download(fp32.ciphertext_sha256, 10))
            assert got == denied


async def _raw_download(conn, artifact: str, offset: int) -> bytes:
    call = conn._stub.Download(
        device_pb2.DownloadRequest(artifact=artifact, offset=offset), metadata=conn._metadata
    )
    return b"".join([chunk.data async for chunk in call])


def test_hostile_sync_inputs_are_refused(plane, run_id):
    cp = plane
    device = enroll(cp, run_id)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    many = [
        device_pb2.InstalledModel(model=f"m{i}", version=1, variant="fp32") for i in range(10_000)
    ]
    assert code_of(lambda: sync_with(device, ANDROID, many)) == bad
    for attrs in (
        {"custom": {f"k{i}": "v" for i in range(1000)}},
        {"custom": {"k": "v" * 129}},
        {"custom": {"k": "a\x00b"}},
        {"custom": {"k\x00": "v"}},
        {"custom": {"platform": "ios"}},
        {"platform": "x" * 10_000},
        {"platform": "ios\u0085"},
        {"tags": [f"t{i}" for i in range(1000)]},
        {"tags": ["has space"]},
        {"ram_mb": -1},
    ):
        msg = device_pb2.DeviceAttributes(**{k: v for k, v in attrs.items()})
        assert code_of(lambda m=msg: sync_with(device, m)) == bad, attrs
    # A message near the 8 MiB limit is refused before it costs anything.
    huge = device_pb2.DeviceAttributes(custom={"k": "v" * (9 << 20)})
    assert code_of(lambda: sync_with(device, huge)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # Unicode within the limits is fine and kept as sent.
    sync_with(device, {**ANDROID, "device_model": "Pixel \u2603 8", "custom": {"run": run_id}})


def test_forged_or_reshuffled_answers_are_rejected(plane, run_id):
    cp = plane
    a = enroll(cp, run_id)
    b = enroll(cp, run_id)
    rollout(cp, run_id, 2)
    keys = load_public_keys(a.signing_keys)
    now = dt.datetime.now(dt.UTC)
    response = a.sync_raw()
    verify_sync(response, device_id=a.id, nonce=b"\0" * 16, keys=keys, last_revision=0, now=now)

    def rejected(msg):
        with pytest.raises(AssignmentRejected):
            verify_sync(msg, device_id=a.id, nonce=b"\0" * 16, keys=keys, last_revision=0, now=now)

    # The same model twice.
    doubled = device_pb2.SyncResponse()
    doubled.CopyFrom(response)
    doubled.models.append(response.models[0])
    rejected(doubled)
    # Another version's manifest (itself validly signed).
    v1 = cp.app.delivery.version("det", 1)
    swapped = device_pb2.SyncResponse()
    swapped.CopyFrom(response)
    swapped.models[0].manifest = v1.manifest
    swapped.models[0].manifest_signature = v1.manifest_signature
    rejected(swapped)
    # Server-signed documents that are not canonical, or carry a duplicate key.
    signer = cp.registry.signer
    body = response.document.replace(
        b'"device":"', b'"device":"' + a.id.encode() + b'","device":"', 1
    )
    dup = device_pb2.SyncResponse()
    dup.CopyFrom(response)
    dup.document = body
    dup.document_signature = signer.sign_bytes(body)
    rejected(dup)
    # B's answer replayed to A.
    with pytest.raises(AssignmentRejected, match="another device"):
        verify_sync(
            b.sync_raw(), device_id=a.id, nonce=b"\0" * 16, keys=keys, last_revision=0, now=now
        )
