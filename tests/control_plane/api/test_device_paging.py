"""ListDevices pages by device id, with or without a selector; tokens are validated."""

from __future__ import annotations

import grpc
import pytest

from protos import fleet_pb2, fleet_pb2_grpc
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.helpers import channel_to


def _list(cp, **fields) -> fleet_pb2.ListDevicesResponse:
    with channel_to(cp.address) as channel:
        stub = fleet_pb2_grpc.FleetServiceStub(channel)
        metadata = (("authorization", f"Bearer {cp.token}"),)
        return stub.ListDevices(
            fleet_pb2.ListDevicesRequest(**fields), timeout=30, metadata=metadata
        )


def _walk(cp, selector: str, page_size: int) -> tuple[list[str], list[int]]:
    ids, sizes, token = [], [], ""
    while True:
        page = _list(cp, selector=selector, page_size=page_size, page_token=token)
        ids += [d.id for d in page.devices]
        sizes.append(len(page.devices))
        token = page.next_page_token
        if not token:
            return ids, sizes


def test_devices_page_by_id_and_through_a_selector(cp, enroll_token):
    devices = [
        Device.enroll(cp.address, enroll_token, {"platform": "android" if i % 2 else "ios"})
        for i in range(7)
    ]
    every = sorted(d.id for d in devices)
    android = sorted(d.id for d in devices if d.attributes["platform"] == "android")
    assert _walk(cp, "", 3) == (every, [3, 3, 1])
    ids, sizes = _walk(cp, "platform=android", 2)
    assert ids == android and sizes == [2, 1]
    with cp.client() as client:
        assert [d.id for d in client.list_devices()] == every
        assert [d.id for d in client.list_devices("platform=ios", limit=2)] == sorted(
            d.id for d in devices if d.attributes["platform"] == "ios"
        )[:2]


@pytest.mark.parametrize(
    "fields",
    [
        {"page_token": "%%%"},
        {"page_size": -5},
        # A token from one selector does not continue another listing.
        {"selector": "platform=ios", "page_token": "from-android"},
    ],
)
def test_garbage_device_page_tokens_are_invalid_argument(cp, enroll_token, fields):
    for _ in range(2):
        Device.enroll(cp.address, enroll_token, {"platform": "android"})
    if fields.get("page_token") == "from-android":
        fields["page_token"] = _list(cp, selector="platform=android", page_size=1).next_page_token
    with pytest.raises(grpc.RpcError) as caught:
        _list(cp, **fields)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page" in caught.value.details()


def test_a_forged_token_cannot_carry_a_nul_into_sql(cp):
    # Found by review: a key of the right prefix but with a NUL reached PostgreSQL.
    import hashlib

    from control_plane import paging

    scope = "devices:" + hashlib.sha256(b"").hexdigest()[:16]
    for key in ("dev_\u202e\x00", "dev_A/../x", "dev_" + "a" * 40):
        token = paging._encode(scope, key)
        with pytest.raises(grpc.RpcError) as caught:
            _list(cp, page_token=token)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, key
