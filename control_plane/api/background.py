"""Periodic background work of a server (health probes, garbage sweeps) in daemon threads."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from contract import errors

log = logging.getLogger(__name__)


class Periodic:
    """Runs `task` now and then every `interval_s` seconds in a thread, until stopped.

    The task does blocking I/O (database, blob store), so it never runs on the event
    loop. An error is logged and the next round runs as planned.
    """

    def __init__(self, name: str, interval_s: float, task: Callable[[], object]) -> None:
        self._name, self._interval, self._task = name, interval_s, task
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"skiff-{name}", daemon=True)

    def start(self) -> None:
        """Start the thread (the first round runs at once)."""
        self._thread.start()

    def stop(self) -> None:
        """Stop after the current round; waits for it a little."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._task()
            except errors.SkiffError as exc:
                log.warning("%s: %s", self._name, exc)
            except Exception:  # noqa: BLE001 - one bad round must not end the thread
                log.exception("%s failed", self._name)
            self._stop.wait(self._interval)
