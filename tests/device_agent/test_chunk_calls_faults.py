"""DownloadChunks faults found in review: a lying server, an older one, a closed reader.

Each test failed before its fix.
"""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest

from contract import chunks
from contract.device_client import DeviceCallError, DeviceConnection
from control_plane.api import device_service
from device_agent import chunk_store
from device_agent.download import IntegrityFailure
from tests.device_agent.test_chunk_calls import _SIZES, _Lying, against, serve


def test_calls_in_flight_at_once_all_fall_back_on_an_older_control_plane():
    """The agent has IN_FLIGHT calls at once on one connection: against a control plane
    without DownloadChunks, every one of them is answered UNIMPLEMENTED. The first flips
    the connection to Download; the others found it flipped already and failed."""

    async def main():
        servicer = _Lying("unimplemented")
        server, port = await serve(servicer)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                conn = DeviceConnection(channel, "skd_x")

                async def one():
                    return [item async for item in conn.download_chunks(list(_SIZES.items()))]

                return await asyncio.gather(
                    *(one() for _ in range(chunk_store.IN_FLIGHT)), return_exceptions=True
                )
        finally:
            await server.stop(None)

    results = asyncio.run(main())
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, failed
    assert all(r == [("a", b"a" * 10), ("b", b"b" * 20)] for r in results)


class _Extra(_Lying):
    """Sends both chunks whole, then one message more."""

    async def DownloadChunks(self, request, context):  # noqa: N802
        message = device_service.device_pb2.DownloadChunk
        for name in request.artifacts:
            yield message(artifact=name, offset=0, data=name.encode() * _SIZES[name])
        yield message(artifact="a", offset=0, data=b"a")


def test_a_message_past_the_last_chunk_is_data_loss_not_an_index_error():
    _, error, _ = against(_Extra("fine"))
    assert isinstance(error, DeviceCallError), repr(error)
    assert error.code == grpc.StatusCode.DATA_LOSS


class _AllThenFails:
    """A connection whose call brings every chunk whole, then ends DATA_LOSS (the server
    found the last chunk's blob longer than its table in the hop after it)."""

    def __init__(self, datas):
        self._datas = datas

    async def download_chunks(self, artifacts):
        for (name, _), data in zip(artifacts, self._datas, strict=True):
            yield name, data
        raise DeviceCallError(grpc.StatusCode.DATA_LOSS, "chunk 0123 is longer than 26 bytes")


def test_an_error_after_every_chunk_of_a_call_came_is_an_integrity_failure(tmp_path):
    datas = [b"x" * 26, b"y" * 26]
    refs = [chunks.ChunkRef(hashlib.sha256(d).digest(), len(d) - chunks.TAG_SIZE) for d in datas]
    store = chunk_store.ChunkStore(tmp_path / "chunks")

    async def main():
        got = []
        try:
            async for ref, _data in store._download(_AllThenFails(datas), refs):
                got.append(ref)
        except Exception as exc:  # noqa: BLE001
            return got, exc
        return got, None

    got, error = asyncio.run(main())
    assert got == refs
    assert isinstance(error, IntegrityFailure), repr(error)


def test_a_chunked_install_against_a_control_plane_without_the_call_activates(
    cp, tmp_path, monkeypatch
):
    """End to end: the control plane answers DownloadChunks UNIMPLEMENTED (as one older
    than the call does); the agent's calls in flight at once must all fall back."""
    from protos import device_pb2, device_pb2_grpc
    from tests.device_agent.test_agent import token
    from tests.device_agent.test_chunked_updates import _install, _mnn, _onnx, _push

    real_init = device_pb2_grpc.DeviceServiceStub.__init__

    def older(self, channel):
        real_init(self, channel)
        self.DownloadChunks = channel.unary_stream(
            "/skiff.v1.DeviceService/NoSuchMethod",  # what an older server answers
            request_serializer=device_pb2.DownloadChunksRequest.SerializeToString,
            response_deserializer=device_pb2.DownloadChunk.FromString,
        )

    monkeypatch.setattr(device_pb2_grpc.DeviceServiceStub, "__init__", older)
    # ~12 chunks: two calls at once (CHUNKS_PER_CALL = 8)
    _push(cp, tmp_path, _mnn(_onnx(seed=3)))
    result = _install(cp, tmp_path / "state", 1, enroll_token=token(cp))
    assert result.timings.chunks_fetched > 0


def test_a_chunk_reader_closed_opens_no_more_blobs(monkeypatch):
    """DownloadChunks' `finally` closes the reader in a thread while the read-ahead's
    thread may not yet hold its lock: a next() that runs after close() must not open the
    next chunk's blob (and read up to PIECES_BYTES of it, for nobody, left open)."""
    monkeypatch.setattr(device_service, "PIECES_BYTES", 10)
    opened, closed = [], []

    def read(name):
        opened.append(name)
        try:
            yield name.encode() * 10
        finally:
            closed.append(name)

    pieces = device_service._ChunkPieces(read, ["a", "b"], [10, 10])
    assert pieces.next() == [("a", 0, b"a" * 10)]
    pieces.close()  # the call ended
    late = pieces.next()  # the read-ahead's thread, scheduled before, runs after
    assert late == [] and opened == ["a"], (late, opened)


class _Hangs:
    """A connection whose calls bring their first chunk, then nothing (a stalled link)."""

    def __init__(self, datas, hang=True):
        self.datas, self.hang = datas, hang

    async def download_chunks(self, artifacts):
        for name, _ in artifacts if not self.hang else artifacts[:1]:
            await asyncio.sleep(0.01)
            yield name, self.datas[name]
        if self.hang:
            await asyncio.Event().wait()


@pytest.mark.parametrize("failure", ["cancel", "bad"])
def test_an_install_cancelled_or_failed_mid_download_gives_back_every_room(
    tmp_path, caplog, failure
):
    import gc
    import logging

    datas = {}
    refs = []
    for i in range(40):
        d = bytes([i]) * 40
        if failure == "bad" and i == 9:  # the second call's first chunk fails its id
            ref = chunks.ChunkRef(hashlib.sha256(b"other").digest(), len(d) - chunks.TAG_SIZE)
        else:
            ref = chunks.ChunkRef(hashlib.sha256(d).digest(), len(d) - chunks.TAG_SIZE)
        refs.append(ref)
        datas[ref.id.hex()] = d
    table = chunks.ChunkTable(tuple(refs))
    store = chunk_store.ChunkStore(tmp_path / "chunks")
    made = []
    real = chunk_store.ChunkWrites.__init__

    def keep_writes(self, *a, **kw):
        real(self, *a, **kw)
        made.append(self)

    async def main():
        task = asyncio.ensure_future(store.fetch_missing(_Hangs(datas, failure == "cancel"), table))
        await asyncio.sleep(0.5)
        if failure == "cancel":
            task.cancel()
        try:
            await asyncio.wait_for(task, 5)
        except (asyncio.CancelledError, IntegrityFailure) as exc:
            return type(exc).__name__
        return "returned"

    with caplog.at_level(logging.WARNING), pytest.MonkeyPatch.context() as mp:
        mp.setattr(chunk_store.ChunkWrites, "__init__", keep_writes)
        outcome = asyncio.run(main())
        gc.collect()
    assert outcome == ("CancelledError" if failure == "cancel" else "IntegrityFailure")
    (writes,) = made
    assert writes._room._value == chunk_store.WRITE_BACKLOG  # every room back
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def test_a_hop_reads_at_most_about_pieces_bytes():
    """PIECES_BYTES is what one hop reads (and, with the read-ahead, a call holds two):
    a hop that starts a 1 MiB piece just under the limit reads about twice that."""
    from control_plane.blobs.base import CHUNK_SIZE

    def read(name):
        size = sizes[names.index(name)]
        while size > 0:
            yield b"x" * min(size, CHUNK_SIZE)
            size -= CHUNK_SIZE

    names, sizes = ["a", "b"], [device_service.PIECES_BYTES - 1, CHUNK_SIZE]
    pieces = device_service._ChunkPieces(read, names, sizes)
    hop = sum(len(d) for _, _, d in pieces.next())
    pieces.close()
    assert hop <= max(device_service.PIECES_BYTES, CHUNK_SIZE), hop
