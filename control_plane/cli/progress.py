"""Progress for long CLI operations, drawn by rich on stderr so --json output stays clean.

rich is imported when a bar is made: the agent daemon, which never draws one, shares
this package and should not carry it in memory.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    from rich.console import Console


def stderr_console(stream: TextIO | None = None) -> Console:
    """Return a console on stderr (or `stream`); it draws only on a terminal."""
    from rich.console import Console

    return Console(file=stream or sys.stderr, highlight=False)


class ProgressBar:
    """A transfer progress bar: bytes done, percentage, throughput.

    Draws only on a terminal (a log file or pipe gets no control codes). `after` is shown
    once everything is sent, for work that follows the transfer (a push is validated and
    encrypted by the server).
    """

    def __init__(self, label: str, stream: TextIO | None = None, *, after: str = "") -> None:
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TransferSpeedColumn,
        )

        self._label, self._after = label, after
        console = stderr_console(stream)
        self._enabled = console.is_terminal
        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TaskProgressColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            console=console,
            transient=False,
        )
        self._task = None

    def __call__(self, done: int, total: int) -> None:
        """Report `done` bytes of `total` so far."""
        if not self._enabled:
            return
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task(self._label, total=total)
        label = self._label + (self._after if done >= total else "")
        self._progress.update(self._task, completed=done, total=total, description=label)

    def finish(self) -> None:
        """Stop drawing."""
        if self._task is not None:
            self._progress.stop()
