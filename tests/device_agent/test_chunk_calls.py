"""DownloadChunks: many chunks in one call, checked once, and what a device or server may not do.

The control plane side runs for real (a control plane with a chunked model, a device
enrolled through gRPC); the device side's checks are also run against a server that lies
(pieces out of order, a chunk longer than asked, a stream that stops short, a cut).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from contract import chunks
from contract.device_client import DeviceCallError, DeviceConnection
from control_plane.api import device_service
from tests.control_plane.api.device_helpers import Device, run
from tests.device_agent.conftest import blob_path
from tests.device_agent.test_agent import token
from tests.device_agent.test_chunked_updates import BIG, _device_on_v1, _table


def _fetch(device, artifacts) -> list[tuple[str, bytes]]:
    async def fetch(conn: DeviceConnection):
        return [item async for item in conn.download_chunks(artifacts)]

    return run(device.address, device.credential, fetch)


def _raw(device, artifacts: list[str]) -> list:
    """Call DownloadChunks itself: every message the server sent, or the error it ended on."""

    async def call(conn: DeviceConnection):
        request = device_service.device_pb2.DownloadChunksRequest(artifacts=artifacts)
        return [m async for m in conn._stub.DownloadChunks(request, metadata=conn._metadata)]

    return run(device.address, device.credential, call)


def _pairs(refs) -> list[tuple[str, int]]:
    return [(r.id.hex(), r.ciphertext_size) for r in refs]


def test_a_call_brings_the_assigned_chunks_whole_in_the_order_asked(cp, tmp_path, monkeypatch):
    device, _ = _device_on_v1(cp, tmp_path)
    refs = list(_table(cp, 1).distinct().values())[::-1]  # any order
    # Pieces of at most 64 KiB a thread hop: chunks cross hops and come in several messages.
    monkeypatch.setattr(device_service, "PIECES_BYTES", 64 << 10)
    got = _fetch(device, _pairs(refs))
    assert [name for name, _ in got] == [r.id.hex() for r in refs]
    for (name, data), ref in zip(got, refs, strict=True):
        assert data == blob_path(cp, name).read_bytes()
        assert chunks.chunk_id(data) == ref.id
    messages = _raw(device, [refs[0].id.hex()])
    assert all(m.artifact == refs[0].id.hex() for m in messages)
    assert [m.offset for m in messages] == [
        sum(len(m.data) for m in messages[:i]) for i in range(len(messages))
    ]


def test_a_chunk_the_device_is_not_assigned_refuses_the_whole_call_naming_nothing(cp, tmp_path):
    device, _ = _device_on_v1(cp, tmp_path)
    one, two = _table(cp, 1), _table(cp, 2)
    only_two = next(c for c in two.distinct().values() if c.id not in one.distinct())
    mine = next(iter(one.distinct().values()))
    _, [v2] = cp.registry.show(BIG, 2)
    v2_keys = v2.variant("fp32").chunks["keys"]
    for theirs in (only_two.id.hex(), v2_keys["ciphertext_sha256"], "0" * 64, ""):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            _raw(device, [mine.id.hex(), theirs])  # no byte of the one it may have, either
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert refused.value.details() == "artifact is not assigned to this device"


def test_a_call_asks_for_one_to_the_limit_of_chunks_each_once(cp, tmp_path):
    device, _ = _device_on_v1(cp, tmp_path)
    mine = next(iter(_table(cp, 1).distinct())).hex()
    for artifacts, says in (
        ([], "ask for 1 to 64 chunks a call, not 0"),
        ([mine] * 2, "a chunk is asked for more than once"),
        ([f"{i:064x}" for i in range(chunks.MAX_CHUNKS_PER_CALL + 1)], "not 65"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            _raw(device, artifacts)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in refused.value.details()


def test_a_call_without_a_valid_credential_or_from_a_revoked_device_gets_nothing(cp, tmp_path):
    device, _ = _device_on_v1(cp, tmp_path)
    refs = list(_table(cp, 1).distinct().values())
    device.credential = device.credential[:-2] + "xx"
    with pytest.raises(DeviceCallError) as refused:
        _fetch(device, _pairs(refs))
    assert refused.value.code == grpc.StatusCode.UNAUTHENTICATED
    device = Device.enroll(cp.address, token(cp), {"region": "one"})
    device.sync()
    cp.app.fleet.revoke(device.id, reason="stolen")
    with pytest.raises(DeviceCallError) as refused:
        _fetch(device, _pairs(refs))
    assert refused.value.code in (
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
    )


def test_a_chunk_lost_from_the_store_ends_the_call_after_the_chunks_before_it(cp, tmp_path):
    device, _ = _device_on_v1(cp, tmp_path)
    refs = list(_table(cp, 1).distinct().values())[:4]
    blob_path(cp, refs[2].id.hex()).unlink()
    got = []

    async def fetch(conn: DeviceConnection):
        async for item in conn.download_chunks(_pairs(refs)):
            got.append(item)

    with pytest.raises(DeviceCallError) as lost:
        run(device.address, device.credential, fetch)
    assert lost.value.code == grpc.StatusCode.NOT_FOUND
    assert [name for name, _ in got] == [r.id.hex() for r in refs[:2]]


# A server that lies: the device's own checks of what DownloadChunks sends.


class _Lying(device_service.device_pb2_grpc.DeviceServiceServicer):
    """Serves two chunks, "a" * 10 and "b" * 20, through a scripted fault."""

    def __init__(self, fault: str) -> None:
        self.fault, self.calls, self.downloads = fault, [], []

    async def DownloadChunks(self, request, context):  # noqa: N802
        self.calls.append(list(request.artifacts))
        message = device_service.device_pb2.DownloadChunk
        if self.fault == "unimplemented":
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        if self.fault == "cut" and len(self.calls) == 1:
            yield message(artifact="a", offset=0, data=b"a" * 10)
            yield message(artifact="b", offset=0, data=b"b" * 5)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        script = {
            "order": [("b", 0, b"b" * 20), ("a", 0, b"a" * 10)],
            "gap": [("a", 0, b"a" * 5), ("a", 6, b"a" * 4)],
            "long": [("a", 0, b"a" * 11)],
            "short": [("a", 0, b"a" * 10), ("b", 0, b"b" * 19)],
        }.get(self.fault)
        if script is None:  # "cut" (second call), "fine"
            script = [(name, 0, name.encode() * size) for name, size in _SIZES.items()]
            script = [s for s in script if s[0] in request.artifacts]
        for name, offset, data in script:
            yield message(artifact=name, offset=offset, data=data)

    async def Download(self, request, context):  # noqa: N802
        self.downloads.append(request.artifact)
        size = _SIZES[request.artifact]
        yield device_service.device_pb2.DownloadChunk(
            offset=0, data=request.artifact.encode() * size
        )


_SIZES = {"a": 10, "b": 20}


async def serve(servicer) -> tuple[grpc.aio.Server, int]:
    """Start a device service of `servicer` on a port of its own: (server, port)."""
    server = grpc.aio.server()
    device_service.device_pb2_grpc.add_DeviceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, port


def against(servicer: _Lying) -> tuple[list, Exception | None, _Lying]:
    """Fetch both chunks from `servicer`: (what came, the error it ended on, servicer)."""

    async def main():
        server, port = await serve(servicer)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                conn = DeviceConnection(channel, "skd_x")
                got = []
                try:
                    async for item in conn.download_chunks(list(_SIZES.items())):
                        got.append(item)
                except Exception as exc:  # noqa: BLE001 - the test says which it expects
                    return got, exc, servicer
                return got, None, servicer
        finally:
            await server.stop(None)

    return asyncio.run(main())


@pytest.mark.parametrize(
    ("fault", "says"),
    [
        ("order", "chunk out of order"),
        ("gap", "chunk out of order"),
        ("long", "chunk a is over 10 bytes"),
        ("short", "download ended short"),
    ],
)
def test_a_device_refuses_pieces_out_of_order_or_past_or_short_of_a_chunk(fault, says):
    got, error, _ = against(_Lying(fault))
    assert isinstance(error, DeviceCallError) and error.code == grpc.StatusCode.DATA_LOSS
    assert says in error.message
    assert all(data == name.encode() * _SIZES[name] for name, data in got)


def test_after_a_cut_only_the_chunks_not_yet_whole_are_asked_for_again(monkeypatch):
    monkeypatch.setattr("contract.device_client.backoff_s", lambda attempt: 0)
    got, error, servicer = against(_Lying("cut"))
    assert error is None
    assert got == [("a", b"a" * 10), ("b", b"b" * 20)]
    assert servicer.calls == [["a", "b"], ["b"]]


def test_a_control_plane_without_the_call_is_asked_for_each_chunk_with_download():
    got, error, servicer = against(_Lying("unimplemented"))
    assert error is None
    assert got == [("a", b"a" * 10), ("b", b"b" * 20)]
    assert servicer.calls == [["a", "b"]] and servicer.downloads == ["a", "b"]
