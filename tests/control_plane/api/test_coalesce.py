"""Coalesced reads: many waiters, few reads, every waiter its own answer or the read's error."""

from __future__ import annotations

import asyncio
import threading

import pytest

from contract import errors
from control_plane.api.coalesce import Coalesced


class Table:
    """A read_many that records each call's keys and can be held inside a read."""

    def __init__(self, rows: dict):
        self.rows, self.reads = rows, []
        self.hold, self.inside = threading.Event(), threading.Event()
        self.hold.set()
        self.fail: Exception | None = None

    def read_many(self, keys):
        self.reads.append(list(keys))
        found = {k: self.rows[k] for k in keys if k in self.rows}  # read as the call starts
        self.inside.set()
        self.hold.wait(10)
        if self.fail is not None:
            raise self.fail
        return found


def test_a_storm_of_gets_shares_a_few_reads_and_each_gets_its_own_row():
    table = Table({i: f"row {i}" for i in range(0, 1000, 2)})
    loader = Coalesced(table.read_many, limit=300)

    async def storm():
        return await asyncio.gather(*(loader.get(i % 500) for i in range(1000)))

    got = asyncio.run(storm())
    assert got == [f"row {i % 500}" if i % 2 == 0 else None for i in range(1000)]
    # 500 distinct keys, each read once, at most 300 a read.
    assert sorted(k for keys in table.reads for k in keys) == list(range(500))
    assert len(table.reads) == 2 and max(len(keys) for keys in table.reads) == 300


def test_a_key_asked_for_during_a_read_is_read_again_after_it():
    """What commits before get() is seen: a key queued mid-read waits for the next read."""
    table = Table({"a": 1})
    loader = Coalesced(table.read_many)

    async def scenario():
        table.hold.clear()
        first = asyncio.create_task(loader.get("a"))
        await asyncio.to_thread(table.inside.wait, 10)  # the first read has started
        table.rows["a"] = 2  # committed after that read began, before the second get
        second = asyncio.create_task(loader.get("a"))
        await asyncio.sleep(0)
        table.hold.set()
        return await first, await second

    assert asyncio.run(scenario()) == (1, 2)
    assert table.reads == [["a"], ["a"]]


def test_a_failed_read_fails_its_waiters_and_the_next_read_goes_on():
    table = Table({"a": 1})
    loader = Coalesced(table.read_many)

    async def scenario():
        table.fail = errors.Unavailable("database unreachable")
        failed = await asyncio.gather(loader.get("a"), loader.get("b"), return_exceptions=True)
        table.fail = None
        return failed, await loader.get("a")

    failed, after = asyncio.run(scenario())
    assert [type(e) for e in failed] == [errors.Unavailable, errors.Unavailable]
    assert after == 1


def test_a_cancelled_waiter_leaves_the_others_their_answer():
    table = Table({"a": 1, "b": 2})
    loader = Coalesced(table.read_many)

    async def scenario():
        table.hold.clear()
        gone = asyncio.create_task(loader.get("a"))
        kept = asyncio.create_task(loader.get("a"))
        other = asyncio.create_task(loader.get("b"))
        await asyncio.to_thread(table.inside.wait, 10)
        gone.cancel()
        table.hold.set()
        with pytest.raises(asyncio.CancelledError):
            await gone
        return await kept, await other

    assert asyncio.run(scenario()) == (1, 2)


def test_stopping_the_loop_mid_read_leaves_no_waiter_hanging():
    table = Table({"a": 1})
    loader = Coalesced(table.read_many)

    async def scenario():
        table.hold.clear()
        waiters = [asyncio.create_task(loader.get(k)) for k in ("a", "b")]
        await asyncio.to_thread(table.inside.wait, 10)
        late = asyncio.create_task(loader.get("c"))  # queued for a read that never comes
        await asyncio.sleep(0)
        loader._reader.cancel()  # what asyncio.run's shutdown does to a pending task
        results = await asyncio.gather(*waiters, late, return_exceptions=True)
        table.hold.set()
        return results

    results = asyncio.run(scenario())
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results


def test_a_reader_cancelled_before_it_ran_does_not_wedge_the_loader():
    loader = Coalesced(lambda keys: {k: k.upper() for k in keys})

    async def scenario():
        first = asyncio.create_task(loader.get("a"))
        await asyncio.sleep(0)  # get() ran: its reader task exists but has not started
        loader._reader.cancel()  # so its `finally` never runs
        await asyncio.sleep(0)
        return await asyncio.wait_for(loader.get("b"), 10), await asyncio.wait_for(first, 10)

    assert asyncio.run(scenario()) == ("B", "A")


def test_callers_that_leave_during_a_long_read_leave_nothing_queued():
    table = Table({"x": 1})
    loader = Coalesced(table.read_many)

    async def scenario():
        table.hold.clear()
        first = asyncio.create_task(loader.get("x"))
        await asyncio.to_thread(table.inside.wait, 10)
        for _ in range(100):  # one device reconnecting again and again, each time cancelled
            leaving = asyncio.create_task(loader.get("dev_a"))
            await asyncio.sleep(0)
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving
        queued = dict(loader._queued)
        table.hold.set()
        return queued, await first

    queued, first = asyncio.run(scenario())
    assert queued == {} and first == 1
    assert table.reads == [["x"]]  # nobody was left to read dev_a for
