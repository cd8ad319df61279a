"""Every new RPC refuses a missing or wrong credential, and the two kinds do not mix:
a device credential opens no operator RPC, and an operator token no device RPC."""

from __future__ import annotations

import grpc
import pytest

from protos import device_pb2, device_pb2_grpc, fleet_pb2, fleet_pb2_grpc
from tests.control_plane.api.device_helpers import Device

OPERATOR_CALLS = [
    ("FleetService", "CreateEnrollmentToken", fleet_pb2.CreateEnrollmentTokenRequest()),
    ("FleetService", "ListDevices", fleet_pb2.ListDevicesRequest()),
    ("FleetService", "GetDevice", fleet_pb2.GetDeviceRequest(id="dev_0000000000000000")),
    ("FleetService", "RevokeDevice", fleet_pb2.RevokeDeviceRequest(id="dev_0000000000000000")),
    ("RolloutService", "CreateRollout", fleet_pb2.CreateRolloutRequest(model="det", version=1)),
    ("RolloutService", "ListRollouts", fleet_pb2.ListRolloutsRequest()),
    ("RolloutService", "GetRollout", fleet_pb2.GetRolloutRequest(id="ro_0000000000")),
    (
        "RolloutService",
        "TransitionRollout",
        fleet_pb2.TransitionRolloutRequest(id="ro_0000000000", action="pause"),
    ),
]
DEVICE_CALLS = [
    ("Sync", device_pb2.SyncRequest(nonce=b"\0" * 16)),
    ("Watch", device_pb2.WatchRequest()),
    ("Download", device_pb2.DownloadRequest(artifact="0" * 64)),
]
STUBS = {
    "FleetService": fleet_pb2_grpc.FleetServiceStub,
    "RolloutService": fleet_pb2_grpc.RolloutServiceStub,
}


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if hasattr(result, "__iter__") and not hasattr(result, "ListFields"):
            list(result)
    return caught.value.code()


@pytest.fixture
def device(cp, enroll_token):
    return Device.enroll(cp.address, enroll_token, {"platform": "android"})


def test_operator_rpcs_refuse_missing_wrong_and_device_credentials(cp, device):
    with cp.channel() as channel:
        for service, method, request in OPERATOR_CALLS:
            rpc = getattr(STUBS[service](channel), method)
            for metadata in (
                (),
                (("authorization", "Bearer skf_" + "x" * 43),),
                (("authorization", f"Bearer {device.credential}"),),
            ):
                code = _code(lambda r=rpc, q=request, m=metadata: r(q, metadata=m, timeout=10))
                assert code == grpc.StatusCode.UNAUTHENTICATED, method
    with cp.client() as client:  # nothing was created or revoked on the way
        assert client.list_rollouts() == []
        assert not client.get_device(device.id).revoked


def test_device_rpcs_refuse_missing_wrong_and_operator_credentials(cp, device):
    with cp.channel() as channel:
        stub = device_pb2_grpc.DeviceServiceStub(channel)
        for method, request in DEVICE_CALLS:
            rpc = getattr(stub, method)
            for metadata in (
                (),
                (("authorization", "Bearer skd_" + "x" * 43),),
                (("authorization", f"Bearer {cp.token}"),),
            ):
                code = _code(lambda r=rpc, q=request, m=metadata: r(q, metadata=m, timeout=10))
                assert code == grpc.StatusCode.UNAUTHENTICATED, method
