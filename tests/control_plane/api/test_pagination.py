"""ListModels and GetModel page through keys: bounded pages, opaque validated tokens."""

from __future__ import annotations

import base64
import dataclasses
import json

import grpc
import pytest

from contract import errors
from control_plane import paging
from control_plane.crypto.kek import WrappedKey
from protos import admin_pb2, admin_pb2_grpc
from tests.control_plane.helpers import channel_to
from tests.control_plane.store.test_store_conformance import _builder

MESSAGE_LIMIT = 8 << 20


def _add_versions(cp, name: str, count: int, *, manifest_bytes: int = 0) -> None:
    """Store versions directly (no MNN): paging is about rows, not models."""
    active = cp.registry.store.kek_state().active_kek_id
    for _ in range(count):
        build = _builder(name)

        def padded(number: int, build=build):
            version = build(number)
            return dataclasses.replace(
                version,
                manifest=b"m" * manifest_bytes or version.manifest,
                # Rows must name the KEK the store has active, or it refuses them as stale.
                data_key=WrappedKey(active, version.data_key.ciphertext),
            )

        cp.registry.store.create_version(name, padded)


def _stub_call(cp, method: str, request):
    with channel_to(cp.address) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        metadata = (("authorization", f"Bearer {cp.token}"),)
        return getattr(stub, method)(request, timeout=30, metadata=metadata)


def test_list_models_pages_in_name_order(cp):
    names = [f"m{i:02d}" for i in range(7)]
    for name in reversed(names):
        _add_versions(cp, name, 1)
    seen, token, sizes = [], "", []
    while True:
        page = _stub_call(
            cp, "ListModels", admin_pb2.ListModelsRequest(page_size=3, page_token=token)
        )
        seen += [m.name for m in page.models]
        sizes.append(len(page.models))
        token = page.next_page_token
        if not token:
            break
    assert seen == names and sizes == [3, 3, 1]
    with cp.client() as client:
        assert [m.name for m in client.list_models()] == names
        assert [m.name for m in client.list_models(limit=4)] == names[:4]
        assert client.models_page(4).next_page_token
        assert not client.models_page(7).next_page_token


def test_default_page_size_applies_to_zero(cp):
    for i in range(paging.DEFAULT_PAGE_SIZE + 1):
        _add_versions(cp, f"m{i:03d}", 1)
    page = _stub_call(cp, "ListModels", admin_pb2.ListModelsRequest())
    assert len(page.models) == paging.DEFAULT_PAGE_SIZE and page.next_page_token
    last = _stub_call(
        cp, "ListModels", admin_pb2.ListModelsRequest(page_token=page.next_page_token)
    )
    assert [m.name for m in last.models] == [f"m{paging.DEFAULT_PAGE_SIZE:03d}"]
    assert last.next_page_token == ""


def test_get_model_pages_versions_oldest_first(cp):
    _add_versions(cp, "det", 5)
    first = _stub_call(cp, "GetModel", admin_pb2.GetModelRequest(name="det", page_size=2))
    assert [v.version for v in first.versions] == [1, 2] and first.model.version_count == 5
    with cp.client() as client:
        assert [v.version for v in client.get_model("det").versions] == [1, 2, 3, 4, 5]
        limited = client.get_model("det", limit=3)
        assert [v.version for v in limited.versions] == [1, 2, 3]
        assert limited.next_page_token
        assert [v.version for v in client.get_model("det", 4).versions] == [4]
        with pytest.raises(errors.NotFound, match="'ghost' not found"):
            client.get_model("ghost")


def test_large_versions_are_cut_into_pages_that_fit_a_message(cp):
    # Ten 1 MiB manifests: one response of all of them would pass the 8 MiB limit.
    _add_versions(cp, "big", 10, manifest_bytes=1 << 20)
    page = _stub_call(cp, "GetModel", admin_pb2.GetModelRequest(name="big"))
    assert page.ByteSize() <= paging.MAX_PAGE_BYTES + (1 << 20) < MESSAGE_LIMIT
    assert 1 <= len(page.versions) < 10 and page.next_page_token
    with cp.client() as client:
        assert [v.version for v in client.get_model("big").versions] == list(range(1, 11))


def _token(body: object) -> str:
    return base64.urlsafe_b64encode(json.dumps(body).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    ("method", "request_"),
    [
        ("ListModels", admin_pb2.ListModelsRequest(page_token="!!not base64!!")),
        ("ListModels", admin_pb2.ListModelsRequest(page_token=_token([1, 2]))),
        ("ListModels", admin_pb2.ListModelsRequest(page_token=_token({"s": "models", "a": 7}))),
        ("ListModels", admin_pb2.ListModelsRequest(page_token=_token({"s": "models", "a": "A B"}))),
        ("ListModels", admin_pb2.ListModelsRequest(page_token="x" * 600)),
        ("ListModels", admin_pb2.ListModelsRequest(page_size=-1)),
        # A token for another listing is refused, not misread.
        (
            "GetModel",
            admin_pb2.GetModelRequest(name="det", page_token=_token({"s": "models", "a": "det"})),
        ),
        (
            "GetModel",
            admin_pb2.GetModelRequest(
                name="det", page_token=_token({"s": "versions:other", "a": 1})
            ),
        ),
        (
            "GetModel",
            admin_pb2.GetModelRequest(
                name="det", page_token=_token({"s": "versions:det", "a": -3})
            ),
        ),
        (
            "GetModel",
            admin_pb2.GetModelRequest(
                name="det", page_token=_token({"s": "versions:det", "a": True})
            ),
        ),
    ],
)
def test_garbage_page_tokens_are_invalid_argument(cp, method, request_):
    _add_versions(cp, "det", 1)
    with pytest.raises(grpc.RpcError) as caught:
        _stub_call(cp, method, request_)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page" in caught.value.details()
