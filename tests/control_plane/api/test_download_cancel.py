"""A Download cancelled while its next piece is read in a thread (the device went away).

Found in review: closing the blob while a thread was inside next() raised "generator
already executing" and the call ended INTERNAL, with an error logged per dropped device.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from control_plane.api import device_service
from control_plane.api.device_service import DeviceServicer
from protos import device_pb2

WAIT_S = 10  # an upper bound on a loaded machine, never a pace


class _Fleet:
    def authenticate(self, authorization, *, cached_only=False):
        return object()


class _Context:
    def __init__(self):
        self.aborted = None

    def invocation_metadata(self):
        return (("authorization", "Bearer skd_x"),)

    async def abort(self, code, details=""):
        self.aborted = (code, details)
        raise RuntimeError("aborted")


async def _cancel_next(stream, inside: threading.Event) -> str:
    """Ask for the stream's next message; cancel that once a thread is inside the read
    behind it (the device went away). Return how the call ended."""
    task = asyncio.ensure_future(stream.__anext__())
    await asyncio.to_thread(inside.wait, WAIT_S)
    task.cancel()
    try:
        await task
        return "returned"
    except asyncio.CancelledError:
        return "cancelled"
    except BaseException as exc:  # noqa: BLE001
        return f"raised {exc!r}"


def test_cancel_during_a_threaded_read_closes_cleanly(caplog):
    inside, release, was_closed = threading.Event(), threading.Event(), threading.Event()
    closed = []

    def pieces():
        try:
            yield b"a" * 10
            inside.set()
            release.wait(WAIT_S)  # a slow disk / S3 read
            yield b"b" * 10
        finally:
            closed.append(True)
            was_closed.set()

    servicer = DeviceServicer.__new__(DeviceServicer)
    servicer._fleet = _Fleet()
    gen = pieces()
    servicer._open = lambda authorization, request: (20, next(gen), gen)
    ctx = _Context()

    async def main():
        stream = servicer.Download(device_pb2.DownloadRequest(artifact="x", offset=0), ctx)
        first = await stream.__anext__()
        assert first.data == b"a" * 10
        outcome = await _cancel_next(stream, inside)
        release.set()
        await asyncio.to_thread(was_closed.wait, WAIT_S)  # once the read in progress is done
        return outcome

    with caplog.at_level(logging.WARNING):
        outcome = asyncio.run(main())
    assert outcome == "cancelled", outcome
    assert ctx.aborted is None, ctx.aborted
    assert closed == [True]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_chunk_call_cancelled_while_its_next_pieces_are_read_closes_cleanly(caplog, monkeypatch):
    """DownloadChunks reads the next pieces while it sends the ones before: the device
    going away then leaves a thread inside a read, and the chunk is closed after it."""
    inside, release, was_closed = threading.Event(), threading.Event(), threading.Event()
    closed = []

    def pieces(name):
        try:
            yield b"a" * 10
            inside.set()
            release.wait(WAIT_S)
            yield b"b" * 10
        finally:
            closed.append(name)
            was_closed.set()

    monkeypatch.setattr(device_service, "PIECES_BYTES", 10)  # one piece a read
    servicer = DeviceServicer.__new__(DeviceServicer)
    servicer._fleet = _Fleet()

    def open_chunks(authorization, request):
        reader = device_service._ChunkPieces(pieces, ["c"], [20])
        return reader.next(), reader

    servicer._open_chunks = open_chunks
    ctx = _Context()

    async def main():
        stream = servicer.DownloadChunks(device_pb2.DownloadChunksRequest(artifacts=["c"]), ctx)
        first = await stream.__anext__()
        assert (first.artifact, first.offset, first.data) == ("c", 0, b"a" * 10)
        outcome = await _cancel_next(stream, inside)
        assert not closed  # the read in progress holds the chunk open
        release.set()
        await asyncio.to_thread(was_closed.wait, WAIT_S)
        return outcome

    with caplog.at_level(logging.WARNING):
        outcome = asyncio.run(main())
    assert outcome == "cancelled", outcome
    assert ctx.aborted is None, ctx.aborted
    assert closed == ["c"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
