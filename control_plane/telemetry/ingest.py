"""Group commit for Report: one writer thread stores whatever batches have queued up.

Each Report call validates its batch, hands it over and waits for its own result. The
writer takes every batch waiting (up to `max_group`) and stores them in one transaction
(`TelemetryStore.add_reports`), so a fleet reporting at once costs one commit per group,
not one per device: the commit (an fsync on SQLite, a round trip on PostgreSQL) was most
of a Report's cost. A caller is answered only after its batch is committed, so an
acknowledged batch is never lost; a batch the store refuses fails only its own call.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable

from control_plane import errors
from control_plane.store.telemetry import ReportBatch, TelemetryStore

log = logging.getLogger(__name__)

MAX_GROUP = 512
MAX_QUEUED = 20_000  # batches waiting; beyond this Report answers Unavailable (retry later)

_STOP = object()


class ReportWriter:
    """Stores report batches in groups, from one thread; `submit` returns a future."""

    def __init__(
        self,
        store: TelemetryStore,
        *,
        max_group: int = MAX_GROUP,
        on_stored: Callable[[list[ReportBatch]], None] | None = None,
    ) -> None:
        self._store, self._max, self._on_stored = store, max_group, on_stored
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, batch: ReportBatch) -> concurrent.futures.Future:
        """Queue a batch; the future resolves to True (stored) or False (a repeat)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise errors.Unavailable("the server is shutting down; report again later")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="skiff-report", daemon=True)
                self._thread.start()
            try:
                self._queue.put_nowait((batch, future))
            except queue.Full:
                raise errors.Unavailable("too many reports waiting; report again later") from None
        return future

    def close(self, timeout: float = 10.0) -> None:
        """Store what is queued, then stop the thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._queue.put(_STOP)
            thread.join(timeout)

    def _run(self) -> None:
        stop = False
        while not stop:
            group = [self._queue.get()]
            while len(group) < self._max:
                try:
                    group.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            if any(item is _STOP for item in group):
                stop = True
                group = [item for item in group if item is not _STOP]
            # A call that went away cancelled its future: its batch is dropped (the
            # device sends it again). The rest can no longer be cancelled.
            group = [item for item in group if item[1].set_running_or_notify_cancel()]
            if group:
                try:
                    self._write(group)
                except Exception:  # noqa: BLE001 - the writer must outlive any one group
                    log.exception("report writer: a group of %d failed", len(group))

    def _write(self, group: list) -> None:
        batches = [batch for batch, _ in group]
        try:
            results = self._store.add_reports(batches)
        except Exception as exc:  # noqa: BLE001 - every waiting caller must hear of it
            if not isinstance(exc, errors.SkiffError):
                log.exception("storing %d report batches failed", len(batches))
                exc = errors.Unavailable("storing the report failed; report again later")
            results = [exc] * len(group)
        for (_, future), result in zip(group, results, strict=True):
            if isinstance(result, Exception):
                future.set_exception(result)
            else:
                future.set_result(result)
        if self._on_stored is not None:
            stored = [b for b, r in zip(batches, results, strict=True) if r is True]
            if stored:
                self._on_stored(stored)
