"""The role table, walked: every RPC of every service, called with every role's token,
with no token, and with garbage, against a real server."""

from __future__ import annotations

import logging

import grpc
import pytest

from control_plane.api import roles
from control_plane.api.access import check_table
from protos import admin_pb2, device_pb2, fleet_pb2
from tests.control_plane.helpers import start_control_plane

SERVICES = [
    admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
    fleet_pb2.DESCRIPTOR.services_by_name["FleetService"],
    fleet_pb2.DESCRIPTOR.services_by_name["RolloutService"],
    device_pb2.DESCRIPTOR.services_by_name["DeviceService"],
]
METHODS = [(f"/{s.full_name}/{m.name}", m) for s in SERVICES for m in s.methods]
DENIED = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED}


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    plane = start_control_plane(tmp_path_factory.mktemp("roles") / "home")
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def tokens(plane):
    with plane.client() as client:
        return {
            role: client.create_api_token(role=role, name=f"walk-{role}").secret
            for role in roles.ROLES
        }


def _call(channel: grpc.Channel, path: str, method, metadata, payload: bytes = b""):
    """Call `path` with a raw request body; return the status code."""
    ident = bytes  # send and receive raw bytes: no client-side parsing gets in the way
    kind = (method.client_streaming, method.server_streaming)
    make = {
        (False, False): channel.unary_unary,
        (False, True): channel.unary_stream,
        (True, False): channel.stream_unary,
        (True, True): channel.stream_stream,
    }[kind]
    rpc = make(path, request_serializer=ident, response_deserializer=ident)
    request = iter([payload]) if method.client_streaming else payload
    try:
        result = rpc(request, metadata=metadata, timeout=20)
        if method.server_streaming:
            for _ in result:
                break  # Watch never ends on its own: one message (or a status) is enough
            result.cancel()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_the_table_lists_every_rpc_and_nothing_else():
    served = {path for path, _ in METHODS}
    listed = {path for path, needed in roles.RPC_ROLES.items() if path.startswith("/skiff.")}
    assert served == listed
    check_table(served)
    with pytest.raises(RuntimeError, match="Secret"):
        check_table([*served, "/skiff.v1.AdminService/Secret"])


@pytest.mark.parametrize("path,method", METHODS, ids=[p for p, _ in METHODS])
def test_every_rpc_with_every_role(plane, tokens, path, method):
    needed = roles.RPC_ROLES[path]
    with plane.channel() as channel:
        for role, secret in tokens.items():
            code = _call(channel, path, method, (("authorization", f"Bearer {secret}"),))
            if needed in roles.ROLES and roles.grants(role, needed):
                assert code not in DENIED, (role, code)
            elif needed in roles.ROLES:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (role, code)
            else:  # device and enrollment calls: an API token is no device credential
                assert code in DENIED, (role, code)
        assert _call(channel, path, method, ()) == grpc.StatusCode.UNAUTHENTICATED or (
            needed == roles.ENROLLMENT
        )


def test_roles_nest_as_documented():
    assert roles.grants(roles.ADMIN, roles.PUBLISHER)
    assert roles.grants(roles.OPERATOR, roles.VIEWER)
    assert roles.grants(roles.PUBLISHER, roles.VIEWER)
    assert not roles.grants(roles.PUBLISHER, roles.OPERATOR)
    assert not roles.grants(roles.OPERATOR, roles.PUBLISHER)
    assert not roles.grants(roles.VIEWER, roles.PUBLISHER)
    assert not roles.grants(roles.OPERATOR, roles.ADMIN)
    assert not roles.grants(roles.ADMIN, roles.DEVICE)


def test_malformed_messages_are_refused_without_a_log_line(plane, tokens, caplog):
    garbage = b"\xff\xff\xff\xff\x0f"  # a field tag with an invalid wire type
    listing = next(m for p, m in METHODS if p.endswith("/ListModels"))
    push = next(m for p, m in METHODS if p.endswith("/PushModel"))
    sync = next(m for p, m in METHODS if p.endswith("/Sync"))
    admin = (("authorization", f"Bearer {tokens['admin']}"),)
    caplog.set_level(logging.DEBUG)
    with plane.channel() as channel:
        for path, method, metadata, want in [
            ("/skiff.v1.AdminService/ListModels", listing, admin, "INVALID_ARGUMENT"),
            ("/skiff.v1.AdminService/PushModel", push, admin, "INVALID_ARGUMENT"),
            ("/skiff.v1.DeviceService/Sync", sync, (), "INVALID_ARGUMENT"),
            # Anonymous: refused before the body is read at all.
            ("/skiff.v1.AdminService/ListModels", listing, (), "UNAUTHENTICATED"),
        ]:
            for _ in range(20):
                assert _call(channel, path, method, metadata, garbage).name == want, path
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info]
    assert noisy == [], [r.getMessage() for r in noisy]
