"""Free text from callers is bounded and clean, and bad numbers get INVALID_ARGUMENT.

Real server on SQLite and PostgreSQL (which refuses NUL in text columns: before the
checks, a NUL in notes came back as INTERNAL with nothing logged).
"""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from contract import errors
from contract.limits import MAX_NAME, MAX_NOTES, MAX_REASON
from control_plane.store.sql_store import SqlStore
from protos import admin_pb2, admin_pb2_grpc, fleet_pb2
from tests.control_plane.helpers import channel_to
from tests.control_plane.store.test_store_conformance import _builder

CONTROL = ["nul\x00byte", "esc\x1b[31mred", "bell\x07", "c1\x9b"]


def _push_raw(cp, header: admin_pb2.PushHeader, payload: bytes):
    """Push through the bare stub, so the header says whatever the test wants."""

    def requests():
        yield admin_pb2.PushModelRequest(header=header)
        yield admin_pb2.PushModelRequest(chunk=payload)

    with channel_to(cp.address) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        return stub.PushModel(
            requests(), timeout=60, metadata=(("authorization", f"Bearer {cp.token}"),)
        )


@pytest.mark.parametrize("notes", [*CONTROL, "x" * (MAX_NOTES + 1)])
def test_bad_notes_are_invalid_argument_and_store_nothing(cp, onnx_path, notes):
    with cp.client() as client, pytest.raises(errors.InvalidArgument, match="notes must"):
        client.push(onnx_path, name="det", notes=notes)
    assert cp.registry.store.list_models() == []
    assert list(cp.registry.blobs.keys()) == []


def test_notes_at_the_limit_with_newlines_are_kept(cp, onnx_path):
    notes = ("line\twith tab\n" * MAX_NOTES)[: MAX_NOTES - 1] + "é"
    with cp.client() as client:
        client.push(onnx_path, name="det", notes=notes)
        assert client.get_model("det", 1).versions[0].notes == notes


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (-1, "declared size -1 is negative"),
        (5, "upload has 9 bytes, header declared 5"),
        (20, "upload has 9 bytes, header declared 20"),
    ],
)
def test_wrong_declared_size_says_what_is_wrong(cp, declared, message):
    header = admin_pb2.PushHeader(name="det", size=declared)
    with pytest.raises(grpc.RpcError) as caught:
        _push_raw(cp, header, b"123456789")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == message


@pytest.mark.parametrize("version", [-1, 2**31, 2**62])
def test_out_of_range_versions_are_invalid_argument(published, tmp_path, version):
    stub_request = admin_pb2.GetModelRequest(name="det", version=version)
    with channel_to(published.address) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        metadata = (("authorization", f"Bearer {published.token}"),)
        with pytest.raises(grpc.RpcError) as caught:
            stub.GetModel(stub_request, timeout=30, metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "version" in caught.value.details()
        pull = admin_pb2.PullModelRequest(name="det", version=version)
        with pytest.raises(grpc.RpcError) as caught:
            next(iter(stub.PullModel(pull, timeout=30, metadata=metadata)))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("reason", [*CONTROL, "r" * (MAX_REASON + 1)])
def test_bad_rollout_reasons_are_refused(published, reason):
    with published.client() as client:
        request = fleet_pb2.CreateRolloutRequest(model="det", version=1, reason=reason)
        with pytest.raises(errors.InvalidArgument, match="reason must"):
            client.create_rollout(request)
        assert client.list_rollouts() == []
        rollout = client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=1))
        with pytest.raises(errors.InvalidArgument, match="reason must"):
            client.transition_rollout(rollout.id, "pause", reason)
        assert [e.action for e in client.get_rollout(rollout.id).audit] == ["create"]


@pytest.mark.parametrize("text", [*CONTROL, "n" * (MAX_NAME + 1)])
def test_bad_token_names_and_revoke_reasons_are_refused(cp, text):
    with cp.client() as client:
        with pytest.raises(errors.InvalidArgument, match="token name must"):
            client.create_enrollment_token(name=text)
        with pytest.raises(errors.InvalidArgument, match="reason must"):
            reason = text if text in CONTROL else "r" * (MAX_REASON + 1)
            client.revoke_device("dev_0000000000000000", reason)
        with pytest.raises(errors.InvalidArgument, match="'region' must"):
            client.create_enrollment_token(attributes={"region": text * 3})


@pytest.mark.postgres
def test_a_value_postgresql_refuses_is_invalid_argument_and_logged(pg_url, caplog):
    # Behind the checks: if a NUL ever gets past validation, the caller hears
    # INVALID_ARGUMENT (not INTERNAL) and the server says so in its log.
    store = SqlStore(pg_url)
    try:
        build = _builder("nul")
        bad = lambda number: dataclasses.replace(build(number), notes="a\x00b")  # noqa: E731
        with pytest.raises(errors.InvalidArgument, match="refused by the database"):
            store.create_version("det", bad)
    finally:
        store.close()
    assert "database refused a value: DataError" in caplog.text
    assert "a\x00b" not in caplog.text
