"""Sync answered from memory on the event loop: the same answer a worker thread gives,
and a thread whenever the answer needs the database, the KEK or a key rotation's news."""

from __future__ import annotations

import grpc
import pytest

from contract.device_client import DeviceCallError
from control_plane.api.device_service import DeviceServicer
from protos import fleet_pb2
from tests.control_plane.api.device_helpers import Device

ANDROID = {"platform": "android", "app_version": "5.3", "soc": "sm8650"}


@pytest.fixture
def in_thread(monkeypatch):
    """Count the Syncs answered in a worker thread (the rest were answered on the loop)."""
    calls: list[str] = []
    real = DeviceServicer._sync_blocking

    def counted(self, authorization, request):
        calls.append("thread")
        return real(self, authorization, request)

    monkeypatch.setattr(DeviceServicer, "_sync_blocking", counted)
    return calls


def _entry(verified, model="det"):
    m = verified.models[model]
    return (m.version, m.variant, m.uid, m.ciphertext_sha256, m.plaintext_sha256)


def test_a_warm_sync_is_answered_on_the_loop_with_the_same_answer(
    published, enroll_token, in_thread
):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    with cp.client() as client:
        client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=1))
    cold = device.sync()  # the version record and its data key are read: a thread
    assert in_thread == ["thread"]
    warm = device.sync()
    assert in_thread == ["thread"], "a Sync needing nothing new went to a thread"
    assert _entry(warm) == _entry(cold)
    # The key wrapped on the loop opens the model, as the thread's did.
    assert device.install(warm, "det") == device.install(cold, "det")
    assert warm.revision == cold.revision and warm.issued_at >= cold.issued_at


def test_a_change_of_rollouts_is_answered_in_a_thread_and_seen(published, enroll_token, in_thread):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    with cp.client() as client:
        client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=1))
    device.sync()
    device.sync()
    assert len(in_thread) == 1
    with cp.client() as client:
        client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=2))
    # The resolver must reload (a database read): never on the loop.
    newer = device.sync()
    assert newer.models["det"].version == 2
    assert len(in_thread) == 2


def test_a_revoked_device_is_refused_on_the_warm_path(published, enroll_token, in_thread):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    with cp.client() as client:
        client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=1))
    device.sync()
    device.sync()  # the credential is cached now
    with cp.client() as client:
        client.revoke_device(device.id, "stolen")
    with pytest.raises(DeviceCallError) as refused:
        device.sync_raw()
    assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
