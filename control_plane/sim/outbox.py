"""A simulated device's queue of Report batches: the agent's outbox, in memory.

Like `device_agent.report_outbox.Outbox`, it keeps every batch until the control plane has
acknowledged it, sends the oldest first, and is bounded by size and by age: past either
bound the oldest batches go first and are counted, and the next batch sent carries the
count (`dropped_batches`). A batch whose reply was lost is sent again unchanged, the same
batch id and the same count, so the control plane applies it once and the count once.
A batch the control plane refuses as invalid is dropped and counted too.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass

from contract.report_batches import MAX_QUEUE_AGE_S, MAX_QUEUE_BYTES
from protos import device_pb2


@dataclass
class _Queued:
    batch: device_pb2.ReportRequest
    size: int
    queued_at: float
    sent: bool = False  # tried at least once: its dropped count is fixed


class ReportQueue:
    """Report batches waiting for the control plane, oldest first (one event loop)."""

    def __init__(
        self,
        *,
        max_bytes: int = MAX_QUEUE_BYTES,
        max_age_s: float = MAX_QUEUE_AGE_S,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_bytes, self.max_age_s, self._monotonic = max_bytes, max_age_s, monotonic
        self._items: collections.deque[_Queued] = collections.deque()
        self._bytes = 0
        self.unreported = 0  # dropped, not yet carried by a batch the control plane took
        self.dropped = 0  # dropped in all (bounds and refusals)

    def __len__(self) -> int:
        return len(self._items)

    def put(self, batch: device_pb2.ReportRequest) -> None:
        """Queue a batch; drop the oldest if the queue is over its bounds (never this one)."""
        size = batch.ByteSize()
        self._items.append(_Queued(batch, size, self._monotonic()))
        self._bytes += size
        stale = self._monotonic() - self.max_age_s
        while len(self._items) > 1 and (
            self._bytes > self.max_bytes or self._items[0].queued_at < stale
        ):
            self._drop_oldest()

    def head(self) -> device_pb2.ReportRequest | None:
        """Return the oldest batch to send (the same message until it is acked or refused)."""
        if not self._items:
            return None
        first = self._items[0]
        if not first.sent:  # it carries what was dropped before it, once and for all
            first.batch.dropped_batches, self.unreported = self.unreported, 0
            first.sent = True
        return first.batch

    def ack(self, batch: device_pb2.ReportRequest) -> None:
        """Forget the oldest batch: the control plane took it (and its dropped count)."""
        if self._items and self._items[0].batch is batch:
            self._bytes -= self._items.popleft().size

    def refuse(self, batch: device_pb2.ReportRequest) -> None:
        """Drop the oldest batch, refused for good; it and what it carried count as dropped."""
        if self._items and self._items[0].batch is batch:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        item = self._items.popleft()
        self._bytes -= item.size
        self.dropped += 1
        self.unreported += 1 + (item.batch.dropped_batches if item.sent else 0)
