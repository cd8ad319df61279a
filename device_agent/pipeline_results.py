"""A pipeline's results on their way to the apps subscribed to them.

A subscriber that does not keep up loses its oldest results, never the agent's memory:
each subscription holds at most `QUEUE_RESULTS` results and `QUEUE_BYTES` of outputs,
and the next result delivered says how many were dropped before it.
"""

from __future__ import annotations

import asyncio
import collections
from dataclasses import dataclass, field

TYPE_CHECKING = False  # an idle agent (no pipeline pushed to) never imports numpy
if TYPE_CHECKING:
    import numpy as np

QUEUE_RESULTS = 1024
QUEUE_BYTES = 64 << 20
# A tensor message's bytes besides its data and name, at most: tags and lengths, a dtype
# name, and a shape of up to MAX_RANK dimensions as varints.
_TENSOR_BYTES = 128


@dataclass
class Result:
    """One firing's outcome: outputs, or the error that stopped its model run."""

    model: str
    version: int
    trigger: str
    key: int
    ts: int
    window_start: int
    window_end: int
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    error: str = ""

    @property
    def nbytes(self) -> int:
        """Memory its outputs hold, at least its size as a message (what bounds a queue, a batch).

        Names and strings count too: a model of many small outputs with long names sends
        far more than its data, and a batch of them must stay under the message limit.
        """
        strings = len(self.model) + len(self.trigger) + len(self.error.encode())
        tensors = sum(
            a.nbytes + len(name.encode()) + _TENSOR_BYTES for name, a in self.outputs.items()
        )
        return 256 + strings + tensors


class Subscription:
    """One app's stream of a model's results.

    Bounded by QUEUE_RESULTS results and QUEUE_BYTES of outputs: the oldest go first.
    """

    def __init__(self, model: str, loop: asyncio.AbstractEventLoop) -> None:
        self.model = model
        self._loop = loop
        self._queue: collections.deque[Result | None] = collections.deque()
        self._bytes = 0
        self._ready = asyncio.Event()
        self.dropped = 0

    def offer(self, result: Result | None) -> None:
        """Queue a result (None ends the stream); on the subscription's loop only."""
        self._queue.append(result)
        if result is not None:
            self._bytes += result.nbytes
        while len(self._queue) > 1 and (
            len(self._queue) > QUEUE_RESULTS or self._bytes > QUEUE_BYTES
        ):
            dropped = self._queue.popleft()
            if dropped is None:  # never drop the end of the stream
                self._queue.appendleft(None)
                break
            self._bytes -= dropped.nbytes
            self.dropped += 1
        self._ready.set()

    def offer_all(self, results: list[Result]) -> None:
        """Queue a push's results in order; on the subscription's loop only."""
        for result in results:
            self.offer(result)

    async def next(self) -> tuple[Result | None, int]:
        """Wait for the next result; return it (None: stream over) and the drops before it."""
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        result = self._queue.popleft()
        if result is not None:
            self._bytes -= result.nbytes
        dropped, self.dropped = self.dropped, 0
        return result, dropped

    async def next_batch(
        self, max_results: int, max_bytes: int
    ) -> tuple[list[tuple[Result, int]], bool]:
        """Wait for results; return those waiting, and whether the stream is over.

        Each result comes with the drops before it. At most `max_results`, and no more
        than `max_bytes` of outputs unless the first alone is larger. Results are only
        dropped between calls, so only the first can have drops before it.
        """
        while not self._queue:
            self._ready.clear()
            await self._ready.wait()
        batch: list[tuple[Result, int]] = []
        size = 0
        while self._queue and len(batch) < max_results:
            result = self._queue[0]
            if result is None:
                self._queue.popleft()
                return batch, True
            if batch and size + result.nbytes > max_bytes:
                break
            self._queue.popleft()
            self._bytes -= result.nbytes
            size += result.nbytes
            dropped, self.dropped = self.dropped, 0
            batch.append((result, dropped))
        return batch, False
