"""Blocking reads for streaming handlers on the event loop: in threads, one ahead.

A handler that sends a large artifact alternates a read (a blob, a decryption: blocking)
with a send. Read and send in turn, each waits on the other; with the next read started
in a thread before the current piece is sent, the two overlap, and gRPC's flow control
still bounds how far the server runs ahead of a slow reader (one read).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Reader:
    """An iterator's items, one `next()` at a time from any thread; closed once none runs.

    A read left in its thread by a cancelled call may still be running when the call
    closes the reader: the lock makes the close wait for it, not race it.
    """

    def __init__(self, items: Iterator) -> None:
        self._items, self._lock = items, threading.Lock()

    def next(self):
        """Return the next item, None at the end (blocking: call it in a thread)."""
        with self._lock:
            return next(self._items, None)

    def close(self) -> None:
        """Close the iterator, if it can be (blocking until a read in progress returns)."""
        with self._lock:
            close = getattr(self._items, "close", None)
            if close is not None:
                close()


async def read_ahead(
    first: T | None, read: Callable[[], T | None] | None, close: Callable[[], None]
) -> AsyncIterator[T]:
    """Yield `first`, then what each `read()` returns, until one returns None.

    Each `read()` runs in a thread while the item before it is with the consumer; `read`
    None says that `first` is the last (no thread hop just to hear the end). Use it
    under `contextlib.aclosing`: however the consumer stops (the end, an error, a
    cancelled call), a read still in its thread finishes there and is dropped, its error
    unlogged, and `close()` then runs in a thread, not waited for. Only None ends it: an
    empty item (a blob store's empty read) is passed on, not taken for the end.
    """
    item, ahead = first, None
    try:
        while item is not None:
            if read is None:
                yield item
                return
            ahead = asyncio.ensure_future(asyncio.to_thread(read))
            yield item
            item = await ahead
    finally:
        if ahead is not None and not ahead.done():
            ahead.cancel()  # its thread finishes the read; the result is dropped
        elif ahead is not None and not ahead.cancelled():
            ahead.exception()  # a call that ended early does not log the read's error
        item = ahead = None  # a piece read ahead (plaintext, for a pull) is not kept
        asyncio.get_running_loop().run_in_executor(None, close)
