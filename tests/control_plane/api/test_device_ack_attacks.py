"""Attacks on the Ack of a remembered answer (delivery._recent): it must take exactly what
the full check takes, refuse with the same code and message, stay bounded, and never
check a signature on the event loop."""

from __future__ import annotations

import asyncio
import datetime as dt

import grpc
import pytest

from contract import errors
from contract.device_client import DeviceCallError
from control_plane.rollouts import delivery as delivery_module
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.api.test_device_ack import ack, counts
from tests.control_plane.api.test_device_service import ANDROID, code_of, rollout


def _both_paths(delivery, device_id, document, signature):
    """Return (fast, full): each path's result or (type, message) of its refusal."""

    def one():
        try:
            return delivery.accepted(device_id, document, signature)
        except errors.SkiffError as exc:
            return type(exc), str(exc)

    fast = one()
    with delivery._acked_lock:
        remembered = delivery._recent.pop(device_id, None)
    try:
        full = one()
    finally:
        if remembered is not None:
            with delivery._acked_lock:
                delivery._recent[device_id] = remembered
    return fast, full


def _answered_then_rotated(cp, enroll_token):
    """A device with an answer remembered here, signed by a key a rotation since ends in 60 s."""
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    rollout(cp)
    answer = device.sync_raw()
    with cp.client() as client:
        client.rotate_signing_key(overlap_s=60)
    return device, answer


def _end_overlap(cp, monkeypatch) -> None:
    """Move the signing keys' clock past the rotation's overlap."""
    after = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=61)
    monkeypatch.setattr(cp.registry.signer, "_clock", lambda: after)


def test_the_fast_and_the_full_check_agree(published, enroll_token, monkeypatch):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    rollout(cp)
    delivery = cp.app.delivery
    answer = device.sync_raw()
    doc, sig = answer.document, answer.document_signature
    assert delivery._recent[device.id].document_sha256  # remembered: the fast path is taken
    # Taken: the same models.
    fast, full = _both_paths(delivery, device.id, doc, sig)
    assert fast == full and [m.model for m in fast] == ["det"]
    # Expired: the same code and message (the time as the document says it).
    real = delivery._clock
    monkeypatch.setattr(delivery, "_clock", lambda: real() + dt.timedelta(days=2))
    fast, full = _both_paths(delivery, device.id, doc, sig)
    assert fast == full and fast[0] is errors.FailedPrecondition and "expired" in fast[1]
    monkeypatch.setattr(delivery, "_clock", real)
    # A replay of an older revision: the same refusal.
    with delivery._acked_lock:
        delivery._acked[device.id] = answer.revision + 1
    fast, full = _both_paths(delivery, device.id, doc, sig)
    assert fast == full and fast[0] is errors.FailedPrecondition and "older" in fast[1]


def test_a_revoked_device_cannot_ack_its_remembered_answer(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    created = rollout(cp)
    answer = device.sync_raw()  # its credential is cached, its answer remembered
    with cp.client() as client:
        client.revoke_device(device.id, "lost")
    assert code_of(lambda: ack(device, answer.document, answer.document_signature)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert counts(cp, created.id).synced == 0


def test_a_remembered_answer_under_an_ended_key_is_refused_as_checked(
    published, enroll_token, monkeypatch
):
    cp = published
    device, answer = _answered_then_rotated(cp, enroll_token)
    # Within the overlap: still taken (the old key is valid), and counted.
    ack(device, answer.document, answer.document_signature)
    _end_overlap(cp, monkeypatch)
    fast, full = _both_paths(cp.app.delivery, device.id, answer.document, answer.document_signature)
    assert fast == full and fast[0] is errors.InvalidArgument
    with pytest.raises(DeviceCallError) as caught:
        ack(device, answer.document, answer.document_signature)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.message.endswith(full[1])


def test_remembered_answers_are_bounded_and_evicted_ones_still_verify(
    published, enroll_token, monkeypatch
):
    cp = published
    monkeypatch.setattr(delivery_module, "_RECENT_ANSWERS", 2)
    rollout(cp)
    devices = [Device.enroll(cp.address, enroll_token, ANDROID) for _ in range(3)]
    answers = [d.sync_raw() for d in devices]
    assert list(cp.app.delivery._recent) == [devices[1].id, devices[2].id]
    for d, a in zip(devices, answers, strict=True):
        ack(d, a.document, a.document_signature)  # the first one the long way


def test_another_devices_remembered_answer_is_refused(published, enroll_token):
    """Device B acks A's answer while A's is remembered and B's own is too."""
    cp = published
    a = Device.enroll(cp.address, enroll_token, ANDROID)
    b = Device.enroll(cp.address, enroll_token, ANDROID)
    created = rollout(cp)
    b.sync_raw()
    answer = a.sync_raw()
    assert code_of(lambda: ack(b, answer.document, answer.document_signature)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert counts(cp, created.id).synced == 0


# -- reproductions of findings (they pass while the finding stands) -----------------------


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def test_an_answer_under_an_ended_key_is_checked_off_the_event_loop(
    published, enroll_token, monkeypatch
):
    """A remembered answer whose key ended is checked by its signature, as any other: in a
    thread, never on the event loop (a device could make every Ack stall the loop)."""
    cp = published
    device, answer = _answered_then_rotated(cp, enroll_token)
    _end_overlap(cp, monkeypatch)
    where: list[bool] = []
    real = delivery_module.verify_signed

    def spy(*args):
        where.append(_on_loop())
        return real(*args)

    monkeypatch.setattr(delivery_module, "verify_signed", spy)
    assert code_of(lambda: ack(device, answer.document, answer.document_signature)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    # Checked again once the chain is read afresh (another worker may hold a newer key):
    # every check in a thread.
    assert where in ([False], [False, False]), where


def test_a_document_of_another_size_is_never_hashed_on_the_event_loop(
    published, enroll_token, monkeypatch
):
    """The remembered signature with another document of up to 1 MiB: told apart by its
    length, not hashed on the loop."""
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    rollout(cp)
    answer = device.sync_raw()
    hashed: list[tuple[int, bool]] = []
    real = delivery_module.hashlib

    class Spy:
        @staticmethod
        def sha256(data=b""):
            hashed.append((len(data), _on_loop()))
            return real.sha256(data)

    monkeypatch.setattr(delivery_module, "hashlib", Spy)
    big = b"{" + b" " * ((1 << 20) - 2) + b"}"
    assert code_of(lambda: ack(device, big, answer.document_signature)) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (1 << 20, True) not in hashed
