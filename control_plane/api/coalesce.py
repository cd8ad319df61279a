"""Coalesced reads: many coroutines asking for one row each share one read of many rows.

A control plane that restarts has every device reopen its Watch stream at once; each
stream reads its device back from the database. One read per stream, each a thread hop
and two statements, held one server process for ~2 ms of CPU a device: 10,000 devices,
20 s. `Coalesced.get` queues the key instead; while a read runs, keys queue for the next
one, so a storm costs a read per batch and a lone call still gets its read at once (no
timer: the first key starts a read, what arrives meanwhile waits for that one to finish).

Each key's read starts after `get` was called, so what was committed before the call is
seen, as with a read of its own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class Coalesced(Generic[K, V]):
    """Serve `get(key)` from `read_many(keys)`, run in a thread, one batch at a time."""

    def __init__(self, read_many: Callable[[Sequence[K]], Mapping[K, V]], limit: int = 2000):
        self._read_many, self._limit = read_many, limit
        self._queued: dict[K, list[asyncio.Future]] = {}
        self._reader: asyncio.Task | None = None

    async def get(self, key: K) -> V | None:
        """Return `read_many`'s value for `key` (None where it has none); its error, raised."""
        future = asyncio.get_running_loop().create_future()
        waiting = self._queued.setdefault(key, [])
        waiting.append(future)
        # A reader cancelled before its first step never ran its `finally`: start another.
        if self._reader is None or self._reader.done():
            self._reader = asyncio.create_task(self._read())
        try:
            return await future
        except asyncio.CancelledError:
            # The caller left (a stream closed) while its key waited: drop its future, so
            # one device reconnecting during a long read does not pile them up.
            if future in waiting:
                waiting.remove(future)
                if not waiting and self._queued.get(key) is waiting:
                    del self._queued[key]
            raise

    async def _read(self) -> None:
        batch: dict[K, list[asyncio.Future]] = {}
        try:
            while self._queued:
                keys = list(self._queued)[: self._limit]
                batch = {k: self._queued.pop(k) for k in keys}
                try:
                    found = await asyncio.to_thread(self._read_many, keys)
                except Exception as exc:  # noqa: BLE001 - each waiter gets the read's error
                    _settle(batch, lambda f, _key, exc=exc: f.set_exception(exc))
                else:
                    _settle(batch, lambda f, key, found=found: f.set_result(found.get(key)))
        except BaseException:  # cancelled (the server stops): no waiter is left hanging
            _settle(batch, lambda f, _key: f.cancel())
            _settle(self._queued, lambda f, _key: f.cancel())
            self._queued.clear()
            raise
        finally:
            self._reader = None


def _settle(batch: Mapping, settle: Callable[[asyncio.Future, object], object]) -> None:
    for key, futures in batch.items():
        for future in futures:
            if not future.done():  # done: its caller was cancelled
                settle(future, key)
