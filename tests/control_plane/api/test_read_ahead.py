"""Reads one ahead of a streaming handler: overlapped, in order, closed however it ends."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import threading

import pytest

from control_plane.api.read_ahead import Reader, read_ahead

WAIT_S = 10  # an upper bound on a loaded machine, never a pace


def _closing(first, read, close):
    return contextlib.aclosing(read_ahead(first, read, close))


async def _wait_for(flag: threading.Event) -> bool:
    return await asyncio.to_thread(flag.wait, WAIT_S)


def test_the_next_read_runs_while_the_consumer_holds_the_item_before_it():
    reading = threading.Event()
    items = iter([b"b", b"c"])

    def read():
        reading.set()
        return next(items, None)

    async def main():
        got = []
        async with _closing(b"a", read, lambda: None) as stream:
            async for item in stream:
                if item == b"a":  # not asked for b"b" yet: its read is already under way
                    assert await _wait_for(reading), "no read started while b'a' was held"
                got.append(item)
        return got

    assert asyncio.run(main()) == [b"a", b"b", b"c"]


def test_no_read_when_the_first_item_is_the_last():
    closed = threading.Event()

    async def main():
        async with _closing(b"only", None, closed.set) as stream:
            return [item async for item in stream]

    assert asyncio.run(main()) == [b"only"]
    assert closed.wait(WAIT_S)  # in a thread, not waited for by the call


def test_a_failed_read_reaches_the_consumer_and_the_source_is_closed():
    closed = threading.Event()

    def read():
        raise OSError("disk gone")

    async def main():
        async with _closing(b"a", read, closed.set) as stream:
            async for _ in stream:
                pass

    with pytest.raises(OSError, match="disk gone"):
        asyncio.run(main())
    assert closed.wait(WAIT_S)


def test_a_consumer_that_stops_early_closes_after_the_read_in_flight(caplog):
    """The close waits for the read left in its thread; that read's error is not logged."""
    inside, release, closed = threading.Event(), threading.Event(), threading.Event()
    order = []

    def pieces():
        try:
            yield b"a"
            inside.set()
            release.wait(WAIT_S)  # a slow disk
            order.append("read done")
            raise OSError("failed after the consumer left")
        finally:
            order.append("closed")
            closed.set()

    source = pieces()
    reader = Reader(source)

    async def main():
        first = reader.next()
        async with _closing(first, reader.next, reader.close) as stream:
            async for _ in stream:
                assert await _wait_for(inside)
                break  # the client went away
        release.set()
        assert await _wait_for(closed)

    with caplog.at_level(logging.DEBUG):
        asyncio.run(main())
        gc.collect()  # an unretrieved task error is logged when the task is collected
    assert order == ["read done", "closed"]
    assert "never retrieved" not in caplog.text


def test_a_cancelled_call_closes_the_source_once_its_read_returns():
    inside, release, closed = threading.Event(), threading.Event(), threading.Event()

    def pieces():
        try:
            yield b"a"
            inside.set()
            release.wait(WAIT_S)
            yield b"b"
        finally:
            closed.set()

    reader = Reader(pieces())

    async def consume():
        first = reader.next()
        async with _closing(first, reader.next, reader.close) as stream:
            async for _ in stream:
                await asyncio.sleep(WAIT_S)  # stands for a send blocked on flow control

    async def main():
        task = asyncio.ensure_future(consume())
        assert await _wait_for(inside)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not closed.is_set()  # the read in its thread still holds the source
        release.set()
        assert await _wait_for(closed)

    asyncio.run(main())


def test_an_empty_item_is_passed_on_not_taken_for_the_end():
    """A blob store's empty read ended a Download early, silently: only None ends it."""
    items = iter([b"", b"c", None])

    async def main():
        async with _closing(b"", lambda: next(items), lambda: None) as stream:
            return [item async for item in stream]

    assert asyncio.run(main()) == [b"", b"", b"c"]
