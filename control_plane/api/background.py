"""Periodic background work of a server (health probes, garbage sweeps) in daemon threads."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from contract import errors

log = logging.getLogger(__name__)


class Periodic:
    """Runs `task` now and then every `interval_s` seconds in a thread, until stopped.

    The task does blocking I/O (database, blob store), so it never runs on the event
    loop. An error is logged and the next round runs as planned.
    """

    def __init__(
        self, name: str, interval_s: float, task: Callable[[], object], *, at_once: bool = True
    ) -> None:
        self._name, self._interval, self._task = name, interval_s, task
        self._at_once = at_once
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"skiff-{name}", daemon=True)

    def start(self) -> None:
        """Start the thread (the first round runs at once, or after one interval)."""
        self._thread.start()

    def stop(self, timeout: float = 10) -> None:
        """Stop after the current round; waits for it a little."""
        self.signal()
        self.join(time.monotonic() + timeout)

    def signal(self) -> None:
        """Ask the thread to stop after its current round, without waiting."""
        self._stop.set()

    def join(self, deadline: float) -> None:
        """Wait until the thread has stopped or the monotonic `deadline` has passed."""
        if self._thread.is_alive():
            self._thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                log.warning("%s: its round was still running when the server stopped", self._name)

    def _run(self) -> None:
        if not self._at_once:
            self._stop.wait(self._interval)
        while not self._stop.is_set():
            try:
                self._task()
            except errors.SkiffError as exc:
                log.warning("%s: %s", self._name, exc)
            except Exception:  # noqa: BLE001 - one bad round must not end the thread
                log.exception("%s failed", self._name)
            self._stop.wait(self._interval)


def stop_all(tasks: list[Periodic], timeout: float = 10) -> None:
    """Stop every task at once, then wait for them all together for at most `timeout`."""
    for task in tasks:
        task.signal()
    deadline = time.monotonic() + timeout
    for task in tasks:
        task.join(deadline)
