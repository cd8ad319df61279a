"""DeviceService end to end: enrollment, signed assignments, key wrapping, downloads."""

from __future__ import annotations

import datetime as dt
import hashlib

import grpc
import pytest

from contract.assignment import AssignmentRejected, load_public_keys, verify_sync
from contract.device_client import DeviceCallError
from contract.envelope import decrypt_stream
from contract.key_wrap import DeviceKeyPair, KeyUnwrapError
from contract.pinned_keys import PinnedKeyRing
from control_plane.api.fleet_convert import attributes_pb
from protos import fleet_pb2
from runtime.golden import Golden
from tests.control_plane.api.device_helpers import Device, run

ANDROID = {"platform": "android", "app_version": "5.3", "soc": "sm8650"}
NONCE = b"\0" * 16  # what Device.sync_raw sends unless told otherwise
IOS = {"platform": "ios", "app_version": "5.3"}


def rollout(cp, version=1, **kw):
    with cp.client() as client:
        return client.create_rollout(
            fleet_pb2.CreateRolloutRequest(model="det", version=version, **kw)
        )


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(DeviceCallError) as caught:
        fn()
    return caught.value.code


def test_enroll_then_sync_nothing_desired(cp, enroll_token):
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    assert device.id.startswith("dev_") and device.credential.startswith("skd_")
    assert device.signing_keys == [cp.registry.signer.public_key_pem()]
    verified = device.sync()
    assert verified.models == {} and verified.device_id == device.id


def test_enrollment_token_rules(cp):
    keys = DeviceKeyPair.generate().public_keyset()
    with cp.client() as client:
        once = client.create_enrollment_token(uses=1, attributes={"region": "eu", "tags": ["lab"]})
        expired = client.create_enrollment_token(ttl_s=1)

    def enroll(token, attrs=None, keyset=keys):
        return run(cp.address, "", lambda c: c.enroll(token, attributes_pb(attrs or {}), keyset))

    first = enroll(once.token, {"region": "us", "platform": "linux", "tags": ["x"]})
    with cp.client() as client:
        shown = client.get_device(first.device_id)
    # Stamped attributes win over what the device says and are attested; the rest is
    # kept. Stamped tags replace the reported ones (they were the union before).
    assert shown.attributes.region == "eu" and shown.attributes.platform == "linux"
    assert list(shown.attributes.tags) == ["lab"]
    assert (shown.attested.region, list(shown.attested.tags)) == ("eu", ["lab"])
    assert not shown.attested.platform
    with pytest.raises(DeviceCallError, match="used up") as used_up:
        enroll(once.token)
    assert used_up.value.code == grpc.StatusCode.UNAUTHENTICATED
    forged = "ske_" + "A" * 43
    assert code_of(lambda: enroll(forged)) == grpc.StatusCode.UNAUTHENTICATED
    assert code_of(lambda: enroll("not-a-token")) == grpc.StatusCode.UNAUTHENTICATED
    import time

    time.sleep(1.1)
    with pytest.raises(DeviceCallError, match="expired"):
        enroll(expired.token)
    with cp.client() as client:
        assert len(client.list_devices()) == 1  # nothing half-enrolled


def test_enroll_refuses_bad_keys_and_attributes(cp, enroll_token):
    pair = DeviceKeyPair.generate()

    def enroll(attrs, keyset):
        return run(cp.address, "", lambda c: c.enroll(enroll_token, attributes_pb(attrs), keyset))

    for keyset in (b"", b"junk", pair.private_keyset(), b"x" * 5000):
        assert code_of(lambda k=keyset: enroll({}, k)) == grpc.StatusCode.INVALID_ARGUMENT
    bad = {"platform": "a" * 500}
    assert code_of(lambda: enroll(bad, pair.public_keyset())) == grpc.StatusCode.INVALID_ARGUMENT
    with cp.client() as client:
        assert client.list_devices() == []


def test_device_calls_need_a_valid_credential(cp, enroll_token):
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    for credential in ("", "skd_wrong", "Bearer", device.credential + "x"):
        stranger = Device(
            cp.address, device.id, credential, device.keys, [], ANDROID, PinnedKeyRing([])
        )
        assert code_of(stranger.sync_raw) == grpc.StatusCode.UNAUTHENTICATED


def test_only_the_assigned_device_gets_key_and_bytes(published, enroll_token):
    cp = published
    android = Device.enroll(cp.address, enroll_token, ANDROID)
    ios = Device.enroll(cp.address, enroll_token, IOS)
    rollout(cp, version=2, variant="int8", selector="platform=android")
    verified = android.sync()
    model = verified.models["det"]
    assert (model.version, model.variant) == (2, "int8")
    assert model.wrapped_data_key
    plaintext = android.install(verified, "det")
    with cp.client() as client:
        version = client.get_model("det", 2).versions[0]
    int8 = next(v for v in version.variants if v.name == "int8")
    assert hashlib.sha256(plaintext).hexdigest() == int8.plaintext_sha256

    # The iOS device is not selected: no assignment, no bytes, nothing leaked.
    assert ios.sync().models == {}
    with pytest.raises(DeviceCallError) as denied:
        ios.download(model.ciphertext_sha256, model.ciphertext_size)
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
    assert model.ciphertext_sha256 not in denied.value.message
    # Its key does not open the wrapped key, not even with the right context.
    with pytest.raises(KeyUnwrapError):
        ios.keys.unwrap(model.wrapped_data_key, device_id=android.id, version_uid=model.uid)
    # Nor does the right key under another device's or version's context.
    with pytest.raises(KeyUnwrapError):
        android.keys.unwrap(model.wrapped_data_key, device_id=ios.id, version_uid=model.uid)


def test_assigned_device_gets_the_versions_golden_data_and_no_other(published, enroll_token):
    cp = published
    android = Device.enroll(cp.address, enroll_token, ANDROID)
    ios = Device.enroll(cp.address, enroll_token, IOS)
    rollout(cp, version=2, variant="int8", selector="platform=android")
    verified = android.sync()
    m = verified.models["det"]
    assert m.golden is not None and m.degraded is False
    ciphertext = android.download(m.golden.ciphertext_sha256, m.golden.ciphertext_size)
    key = android.keys.unwrap(m.wrapped_data_key, device_id=android.id, version_uid=m.uid)
    data = b"".join(decrypt_stream(key, [ciphertext], associated_data=m.golden.associated_data))
    assert hashlib.sha256(data).hexdigest() == m.golden.plaintext_sha256
    golden = Golden.from_npz(data)
    assert list(golden.inputs) == ["x"] and list(golden.outputs) == ["y"]
    # The unassigned device cannot fetch it, nor version 1's golden data.
    with pytest.raises(DeviceCallError) as denied:
        ios.download(m.golden.ciphertext_sha256, m.golden.ciphertext_size)
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
    v1 = cp.registry.store.get_version("det", 1).golden
    assert code_of(lambda: android.download(v1["ciphertext_sha256"], 10)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # A golden descriptor swapped for another version's fails the signed checks.
    keys = load_public_keys(android.signing_keys)
    response = android.sync_raw()
    swapped = type(response)()
    swapped.CopyFrom(response)
    swapped.models[0].golden.ciphertext_sha256 = v1["ciphertext_sha256"]
    with pytest.raises(AssignmentRejected, match="golden_sha256"):
        verify_sync(
            swapped,
            device_id=android.id,
            nonce=NONCE,
            keys=keys,
            last_revision=0,
            now=dt.datetime.now(dt.UTC),
        )
    dropped = type(response)()
    dropped.CopyFrom(response)
    dropped.models[0].ClearField("golden")
    with pytest.raises(AssignmentRejected, match="golden"):
        verify_sync(
            dropped,
            device_id=android.id,
            nonce=NONCE,
            keys=keys,
            last_revision=0,
            now=dt.datetime.now(dt.UTC),
        )


def test_download_resumes_and_refuses_offsets_past_the_end(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    rollout(cp)
    m = device.sync().models["det"]
    whole = device.download(m.ciphertext_sha256, m.ciphertext_size)
    assert len(whole) == m.ciphertext_size
    assert hashlib.sha256(whole).hexdigest() == m.ciphertext_sha256
    tail = device.download(m.ciphertext_sha256, m.ciphertext_size, offset=1000)
    assert tail == whole[1000:]
    with pytest.raises(DeviceCallError) as past:
        device.download(m.ciphertext_sha256, m.ciphertext_size + 10, offset=m.ciphertext_size + 1)
    assert past.value.code == grpc.StatusCode.OUT_OF_RANGE
    with pytest.raises(DeviceCallError) as unknown:
        device.download("0" * 64, 10)
    assert unknown.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_installed_devices_get_no_key_again(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    rollout(cp)
    device.install(device.sync(), "det")
    again = device.sync().models["det"]
    assert again.wrapped_data_key == b""


def test_signed_assignment_cannot_be_replayed_or_mixed(published, enroll_token):
    cp = published
    a = Device.enroll(cp.address, enroll_token, ANDROID)
    b = Device.enroll(cp.address, enroll_token, ANDROID)
    rollout(cp)
    keys = load_public_keys(a.signing_keys)
    now = dt.datetime.now(dt.UTC)
    response = a.sync_raw()
    verify_sync(response, device_id=a.id, nonce=NONCE, keys=keys, last_revision=0, now=now)
    with pytest.raises(AssignmentRejected, match="another device"):
        verify_sync(response, device_id=b.id, nonce=NONCE, keys=keys, last_revision=0, now=now)
    with pytest.raises(AssignmentRejected, match="older"):
        verify_sync(
            response,
            device_id=a.id,
            nonce=NONCE,
            keys=keys,
            last_revision=response.revision + 1,
            now=now,
        )
    with pytest.raises(AssignmentRejected, match="expired"):
        verify_sync(
            response,
            device_id=a.id,
            nonce=NONCE,
            keys=keys,
            last_revision=0,
            now=now + dt.timedelta(days=2),
        )
    # Another device's wrapped key swapped in: the signed digest no longer matches.
    other = b.sync_raw()
    mixed = type(response)()
    mixed.CopyFrom(response)
    mixed.models[0].wrapped_data_key = other.models[0].wrapped_data_key
    with pytest.raises(AssignmentRejected, match="wrapped_key_sha256"):
        verify_sync(mixed, device_id=a.id, nonce=NONCE, keys=keys, last_revision=0, now=now)
    # A key of our own cannot sign for the server.
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    impostor = Ed25519PrivateKey.generate()
    resigned = type(response)()
    resigned.CopyFrom(response)
    resigned.document_signature = impostor.sign(response.document)
    with pytest.raises(AssignmentRejected, match="signature"):
        verify_sync(resigned, device_id=a.id, nonce=NONCE, keys=keys, last_revision=0, now=now)
    pem = impostor.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(AssignmentRejected):
        verify_sync(
            response,
            device_id=a.id,
            nonce=NONCE,
            keys=load_public_keys([pem]),
            last_revision=0,
            now=now,
        )
    # An answer to another request (another nonce) is refused, even at the same revision.
    with pytest.raises(AssignmentRejected, match="nonce"):
        verify_sync(response, device_id=a.id, nonce=b"\1" * 16, keys=keys, last_revision=0, now=now)


def test_revoked_device_is_refused(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    rollout(cp)
    m = device.sync().models["det"]
    with cp.client() as client:
        shown = client.revoke_device(device.id, "lost")
    assert shown.revoked
    assert code_of(device.sync_raw) == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(DeviceCallError) as denied:
        device.download(m.ciphertext_sha256, m.ciphertext_size)
    assert denied.value.code == grpc.StatusCode.PERMISSION_DENIED
