"""The role table, walked: every RPC of every service, called with every role's token,
with no token, and with garbage, against a real server."""

from __future__ import annotations

import hashlib
import logging
import threading

import grpc
import pytest

from contract import errors
from control_plane.api import roles
from control_plane.api.access import check_table
from control_plane.api.auth import ApiTokens
from control_plane.demo import sample_models
from control_plane.store.sql_store import SqlStore
from protos import admin_pb2, admin_pb2_grpc, device_pb2, fleet_pb2
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


def test_an_operator_cannot_enroll_a_device_of_its_own(plane, tokens):
    # Enrolling plus targeting would hand an operator any model's data key: enrollment
    # tokens are the admin's to make.
    with plane.client(tokens["operator"]) as client:
        with pytest.raises(errors.PermissionDenied, match="CreateEnrollmentToken needs admin"):
            client.create_enrollment_token()


def test_a_revoked_token_stops_an_upload_it_started(plane):
    data = sample_models.tiny_mlp_onnx(seed=9)
    with plane.client() as admin:
        made = admin.create_api_token(role="publisher", name="revoked-mid-push")
    header = admin_pb2.PushHeader(
        name="late", size=len(data), sha256=hashlib.sha256(data).hexdigest()
    )
    opened, revoked = threading.Event(), threading.Event()

    def requests():
        yield admin_pb2.PushModelRequest(header=header)
        opened.set()
        revoked.wait(20)
        yield admin_pb2.PushModelRequest(chunk=data)

    outcome: dict = {}

    def push():
        with plane.channel() as channel:
            try:
                admin_pb2_grpc.AdminServiceStub(channel).PushModel(
                    requests(), metadata=(("authorization", f"Bearer {made.secret}"),), timeout=60
                )
            except grpc.RpcError as exc:
                outcome["error"] = (exc.code(), exc.details())

    thread = threading.Thread(target=push)
    thread.start()
    assert opened.wait(20)
    with plane.client() as admin:
        admin.revoke_api_token(made.token.id)
    revoked.set()
    thread.join(60)
    assert outcome["error"][0] == grpc.StatusCode.UNAUTHENTICATED
    assert "is revoked" in outcome["error"][1]
    with plane.client() as admin, pytest.raises(errors.NotFound):
        admin.get_model("late")


def test_the_last_lasting_admin_token_cannot_be_revoked(tmp_path):
    plane = start_control_plane(tmp_path / "home")  # its own: this one is about the last admin
    with plane.client() as admin:
        first = next(t for t in admin.list_api_tokens() if t.name == "admin")
        brief = admin.create_api_token(role="admin", name="brief", ttl_s=3600)
        # The only other admin token expires within the day: revoking would lock us out.
        with pytest.raises(errors.FailedPrecondition, match="last admin token"):
            admin.revoke_api_token(first.id)
        admin.revoke_api_token(brief.token.id)
        with pytest.raises(errors.InvalidArgument, match="10 years"):
            admin.create_api_token(role="viewer", ttl_s=11 * 365 * 86_400)
    plane.stop()


@pytest.mark.postgres
def test_racing_revocations_of_the_last_two_admins(pg_url):
    """At most one wins, and the loser is told why (no deadlock, no database error)."""
    store_a, store_b = SqlStore(pg_url), SqlStore(pg_url)
    try:
        tokens_a, tokens_b = ApiTokens(store_a), ApiTokens(store_b)
        for round_ in range(6):
            one = tokens_a.create(role="admin", name=f"one{round_}", ttl_s=0, actor="t").record
            two = tokens_a.create(role="admin", name=f"two{round_}", ttl_s=0, actor="t").record
            for other in tokens_a.list():
                if other.role == "admin" and other.id not in (one.id, two.id):
                    tokens_a.revoke(other.id)
            barrier, results = threading.Barrier(2), []

            def revoke(tokens, token_id, barrier=barrier, results=results):
                barrier.wait()
                try:
                    tokens.revoke(token_id)
                    results.append("ok")
                except errors.SkiffError as exc:
                    results.append(type(exc).__name__)

            threads = [
                threading.Thread(target=revoke, args=(tokens_a, one.id)),
                threading.Thread(target=revoke, args=(tokens_b, two.id)),
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            assert sorted(results) == ["FailedPrecondition", "ok"], results
    finally:
        store_a.close()
        store_b.close()
