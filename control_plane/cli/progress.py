"""Progress lines for long CLI operations, on stderr so --json output stays clean."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class ProgressBar:
    """A single self-rewriting line: bytes done, percentage, throughput.

    Draws only on a terminal (a log file or pipe gets no carriage-return noise) and at
    most ten times a second. `after` is shown once everything is sent, for work that
    follows the transfer (a push is validated and encrypted by the server).
    """

    def __init__(self, label: str, stream: TextIO | None = None, *, after: str = "") -> None:
        self._label, self._after = label, after
        self._stream = stream or sys.stderr
        self._enabled = self._stream.isatty()
        self._start = self._last = time.monotonic()

    def __call__(self, done: int, total: int) -> None:
        """Report `done` bytes of `total` so far."""
        now = time.monotonic()
        if not self._enabled or (now - self._last < 0.1 and done < total):
            return
        self._last = now
        rate = done / max(now - self._start, 1e-6) / 1e6
        pct = 100.0 * done / max(total, 1)
        self._stream.write(
            f"\r{self._label} {pct:5.1f}%  {done / 1e6:,.1f}/{total / 1e6:,.1f} MB"
            f"  {rate:,.1f} MB/s{self._after if done >= total else ''}"
        )
        self._stream.flush()

    def finish(self) -> None:
        """End the line."""
        if self._enabled:
            self._stream.write("\n")
            self._stream.flush()
