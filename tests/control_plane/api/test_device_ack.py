"""A device counts as synced only once it acknowledged the answer it accepted (Ack)."""

from __future__ import annotations

import datetime as dt

import grpc
import pytest

from contract.device_client import DeviceCallError
from tests.control_plane.api.device_helpers import Device, run
from tests.control_plane.api.test_device_service import ANDROID, code_of, rollout


def counts(cp, rollout_id: str):
    cp.app.writer.flush()  # device reports are written behind: make them visible now
    with cp.client() as client:
        return client.get_rollout(rollout_id).counts


def ack(device: Device, document: bytes, signature: bytes):
    return run(device.address, device.credential, lambda c: c.ack(document, signature))


def test_synced_only_once_the_answer_is_acknowledged(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    created = rollout(cp)
    answer = device.sync_raw()  # answered, but the device has not accepted it (yet)
    assert answer.models[0].version == 1
    assert counts(cp, created.id).synced == 0
    with cp.client() as client:
        assert client.get_device(device.id).synced == []
    ack(device, answer.document, answer.document_signature)
    assert counts(cp, created.id).synced == 1
    with cp.client() as client:
        (shown,) = client.get_device(device.id).synced
    assert (shown.model, shown.version, shown.variant) == ("det", 1, "fp32")
    # A later answer the device never acknowledges changes nothing it is counted as.
    with cp.client() as client:
        client.transition_rollout(created.id, "rollback")
    assert device.sync_raw().models == []
    assert counts(cp, created.id).synced == 1


def test_an_ack_must_be_of_a_signed_answer_to_this_device(published, enroll_token):
    cp = published
    mine = Device.enroll(cp.address, enroll_token, ANDROID)
    other = Device.enroll(cp.address, enroll_token, ANDROID)
    created = rollout(cp)
    answer = other.sync_raw()
    # Another device's answer, though signed by the control plane.
    assert code_of(lambda: ack(mine, answer.document, answer.document_signature)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # A document edited to name this device no longer verifies.
    forged = answer.document.replace(other.id.encode(), mine.id.encode())
    assert code_of(lambda: ack(mine, forged, answer.document_signature)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # Signed by the control plane, for this device, but expired: Sync again.
    now = dt.datetime.now(dt.UTC)
    stale = cp.registry.signer.sign(
        {
            "schema": "skiff.assignment/v1",
            "device": mine.id,
            "nonce": "00" * 16,
            "revision": answer.revision,
            "issued_at": (now - dt.timedelta(days=2)).isoformat(),
            "expires_at": (now - dt.timedelta(days=1)).isoformat(),
            "models": {"det": {"version": 1, "variant": "fp32"}},
        }
    )
    with pytest.raises(DeviceCallError) as caught:
        ack(mine, stale.body, stale.signature)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "expired" in caught.value.message
    assert code_of(lambda: ack(mine, b"x" * ((1 << 20) + 1), b"")) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # Nothing refused counted anybody as synced.
    assert counts(cp, created.id).synced == 0


def test_an_older_answer_acknowledged_again_is_refused(published, enroll_token):
    """A replay: the device acknowledges v2's answer, then v1's again, to be counted as
    running v1 (found in review). Refused; what it counts as synced stays v2."""
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    first = rollout(cp)
    old = device.sync_raw()
    ack(device, old.document, old.document_signature)
    with cp.client() as client:
        client.transition_rollout(first.id, "rollback")
    rollout(cp, version=2)
    new = device.sync_raw()
    assert new.models[0].version == 2
    ack(device, new.document, new.document_signature)
    ack(device, new.document, new.document_signature)  # the same one again: a retry, fine
    assert code_of(lambda: ack(device, old.document, old.document_signature)) == (
        grpc.StatusCode.FAILED_PRECONDITION
    )
    cp.app.writer.flush()
    with cp.client() as client:
        (shown,) = client.get_device(device.id).synced
    assert shown.version == 2


def test_an_answer_signed_here_lately_is_known_by_its_exact_bytes(published, enroll_token):
    """The Ack of the answer a replica just signed skips the signature check: it must still
    refuse anything but those exact bytes, under that exact signature."""
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    created = rollout(cp)
    answer = device.sync_raw()  # remembered by this replica as the device's last answer
    other = device.sync_raw(nonce=b"\1" * 16)  # and now this one is
    # The remembered document under the signature of another document: checked, refused.
    assert code_of(lambda: ack(device, other.document, answer.document_signature)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # The remembered signature over a document changed by one byte: refused.
    edited = other.document.replace(b'"revision":', b'"revision": ')
    assert edited != other.document
    assert code_of(lambda: ack(device, edited, other.document_signature)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert counts(cp, created.id).synced == 0
    # The earlier answer is no longer remembered but still verifies: taken the long way.
    ack(device, answer.document, answer.document_signature)
    ack(device, other.document, other.document_signature)
    assert counts(cp, created.id).synced == 1


def test_a_remembered_answer_expires_and_its_key_ends(published, enroll_token, monkeypatch):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    rollout(cp)
    answer = device.sync_raw()
    delivery = cp.app.delivery
    real = delivery._clock
    later = real() + dt.timedelta(days=2)  # past the assignment's expiry
    monkeypatch.setattr(delivery, "_clock", lambda: later)
    with pytest.raises(DeviceCallError) as caught:
        ack(device, answer.document, answer.document_signature)
    assert caught.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "expired" in caught.value.message
    monkeypatch.setattr(delivery, "_clock", real)

    # Signed by a key that has ended since (a rotation's overlap is over): refused, as an
    # answer checked by its signature would be.
    answer = device.sync_raw()
    signer = cp.registry.signer
    with cp.client() as client:
        client.rotate_signing_key(overlap_s=60)
    after = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=61)
    monkeypatch.setattr(signer, "_clock", lambda: after)
    assert code_of(lambda: ack(device, answer.document, answer.document_signature)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
