"""The group-commit writer: one transaction per group, each caller its own answer."""

from __future__ import annotations

import asyncio
import threading

import pytest

from contract import errors
from control_plane.telemetry.ingest import ReportWriter


class SlowStore:
    """Stores nothing until let go; records the groups it was given."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        self.groups: list[list[str]] = []

    def add_reports(self, batches, *, check=None):
        self.entered.set()
        self.go.wait(10)
        self.groups.append([b for b in batches])
        return [errors.NotFound("no such device") if b == "ghost" else True for b in batches]


def test_waiting_batches_go_in_one_group_and_each_caller_hears_its_own_result():
    store = SlowStore()
    writer = ReportWriter(store)
    try:
        first = writer.submit("a")  # taken at once; the writer waits in the store
        while not store.groups and not first.running():
            pass
        rest = [writer.submit(x) for x in ("b", "ghost", "c")]
        store.go.set()
        assert first.result(5) is True
        assert rest[0].result(5) is True and rest[2].result(5) is True
        with pytest.raises(errors.NotFound):
            rest[1].result(5)
        assert store.groups == [["a"], ["b", "ghost", "c"]]
    finally:
        writer.close()


def test_a_caller_that_goes_away_does_not_stop_the_writer():
    store = SlowStore()
    writer = ReportWriter(store)
    try:
        first = writer.submit("a")
        while not first.running():
            pass
        gone = writer.submit("b")
        assert gone.cancel()  # the RPC was cancelled while its batch waited
        store.go.set()
        assert first.result(5) is True
        assert writer.submit("c").result(5) is True  # the writer is still there
        assert store.groups == [["a"], ["c"]]
    finally:
        writer.close()


def test_a_closed_writer_refuses_new_batches():
    writer = ReportWriter(SlowStore())
    writer.close()
    with pytest.raises(errors.Unavailable):
        writer.submit("a")


def test_a_coroutine_hears_its_own_result_with_one_loop_wakeup_per_group():
    store = SlowStore()
    writer = ReportWriter(store)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        handovers = []
        threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            if args and isinstance(args[0], list):  # the writer's hand-over of a group
                handovers.append(len(args[0]))
            return threadsafe(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        first = writer.submit_async("a")
        await asyncio.to_thread(store.entered.wait, 5)  # the writer holds "a" in the store
        rest = [writer.submit_async(x) for x in ("b", "ghost", "gone", "c")]
        rest[2].cancel()  # that call went away before the writer took its batch
        store.go.set()
        assert await asyncio.wait_for(first, 5) is True
        assert await rest[0] is True and await rest[3] is True
        with pytest.raises(errors.NotFound):
            await rest[1]
        assert store.groups == [["a"], ["b", "ghost", "c"]]
        assert handovers == [1, 3]  # one wake-up of this loop per group, not per batch

    try:
        asyncio.run(main())
    finally:
        writer.close()


def test_a_coroutine_cancelled_while_its_batch_is_stored_leaves_the_writer_working():
    store = SlowStore()
    writer = ReportWriter(store)

    async def main() -> None:
        first = writer.submit_async("a")
        await asyncio.to_thread(store.entered.wait, 5)
        first.cancel()  # too late to drop the batch: it is stored, nobody is answered
        store.go.set()
        assert await asyncio.wait_for(writer.submit_async("b"), 5) is True
        assert store.groups == [["a"], ["b"]]

    try:
        asyncio.run(main())
    finally:
        writer.close()
