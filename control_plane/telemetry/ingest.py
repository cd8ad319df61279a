"""Group commit for Report: one writer thread stores whatever batches have queued up.

Each Report call validates its batch, hands it over and waits for its own result. The
writer takes every batch waiting (up to `max_group`) and stores them in one transaction
(`TelemetryStore.add_reports`), so a fleet reporting at once costs one commit per group,
not one per device: the commit (an fsync on SQLite, a round trip on PostgreSQL) was most
of a Report's cost. A caller is answered only after its batch is committed, so an
acknowledged batch is never lost; a batch the store refuses fails only its own call.

Refused batches (invalid, or over the reporting budget: control_plane.telemetry.budget)
are counted on their devices by the same thread, a group's refusals in one statement, so a
device sending garbage costs the database no more than one sending reports.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import logging
import queue
import threading
from collections.abc import Callable

from contract import errors
from control_plane.store.report_records import ReportBatch, TelemetryStore
from control_plane.telemetry.budget import check_periods
from control_plane.telemetry.catalog import Catalog

log = logging.getLogger(__name__)

MAX_GROUP = 512
MAX_QUEUED = 20_000  # batches waiting; beyond this Report answers Unavailable (retry later)

_STOP = object()
_REFUSAL = object()
_FLUSH = object()


class ReportWriter:
    """Stores report batches in groups, from one thread; `submit` returns a future."""

    def __init__(
        self,
        store: TelemetryStore,
        *,
        max_group: int = MAX_GROUP,
        on_stored: Callable[[list[ReportBatch]], None] | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        """With a `catalog`, batches naming versions never published are refused."""
        self._store, self._max, self._on_stored = store, max_group, on_stored
        self._catalog = catalog
        self._queue: queue.Queue = queue.Queue(MAX_QUEUED)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, batch: ReportBatch) -> concurrent.futures.Future:
        """Queue a batch; the future resolves to True (stored) or False (a repeat)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._put(batch, future)
        return future

    def submit_async(self, batch: ReportBatch) -> asyncio.Future:
        """Queue a batch from a coroutine; the running loop's future resolves as `submit`'s.

        A group's futures on one loop are resolved in one hand-over to that loop, not one
        wake-up (and GIL hand-back) per batch as `asyncio.wrap_future` would cost.
        """
        future = asyncio.get_running_loop().create_future()
        self._put(batch, future)
        return future

    def _put(self, batch: ReportBatch, future) -> None:
        with self._lock:
            if self._closed:
                raise errors.Unavailable("the server is shutting down; report again later")
            self._start()
            try:
                self._queue.put_nowait((batch, future))
            except queue.Full:
                raise errors.Unavailable("too many reports waiting; report again later") from None

    def refused(self, device_id: str, reason: str, at: dt.datetime) -> None:
        """Count a batch refused before it reached the store (dropped if the queue is full)."""
        with self._lock:
            if self._closed:
                return
            self._start()
            try:
                self._queue.put_nowait((_REFUSAL, (device_id, reason, at)))
            except queue.Full:
                pass

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until everything queued before this call is stored (and refusals counted)."""
        done = threading.Event()
        with self._lock:
            if self._closed:
                return True
            self._start()
            self._queue.put((_FLUSH, done))
        return done.wait(timeout)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="skiff-report", daemon=True)
            self._thread.start()

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
            refusals = [item[1] for item in group if item[0] is _REFUSAL]
            flushed = [item[1] for item in group if item[0] is _FLUSH]
            # A call that went away cancelled its future: its batch is dropped (the
            # device sends it again). The rest can no longer be cancelled.
            group = [
                item
                for item in group
                if item[0] is not _REFUSAL and item[0] is not _FLUSH and _still_wanted(item[1])
            ]
            try:
                if group:
                    refusals += self._write(group)
                if refusals:
                    self._store.note_report_refusals(refusals)
            except Exception:  # noqa: BLE001 - the writer must outlive any one group
                log.exception("report writer: a group of %d failed", len(group))
            for done in flushed:
                done.set()

    def _write(self, group: list) -> list[tuple[str, str, dt.datetime]]:
        """Store a group; return the refusals to count (device, reason, when)."""
        batches = [batch for batch, _ in group]
        unknown = [self._unpublished(b) for b in batches]
        known = [b for b, why in zip(batches, unknown, strict=True) if why is None]
        try:
            stored = iter(self._store.add_reports(known, check=check_periods) if known else ())
            results = [why or next(stored) for why in unknown]
        except Exception as exc:  # noqa: BLE001 - every waiting caller must hear of it
            if not isinstance(exc, errors.SkiffError):
                log.exception("storing %d report batches failed", len(batches))
                exc = errors.Unavailable("storing the report failed; report again later")
            results = [why or exc for why in unknown]
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for (_, future), result in zip(group, results, strict=True):
            if isinstance(future, asyncio.Future):
                by_loop.setdefault(future.get_loop(), []).append((future, result))
            else:
                _settle(future, result)
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle_all, settled)
            except RuntimeError:  # that loop has closed: nobody is waiting any more
                pass
        if self._on_stored is not None:
            stored = [b for b, r in zip(batches, results, strict=True) if r is True]
            if stored:
                self._on_stored(stored)
        return [
            (b.device_id, str(r), b.received_at)
            for b, r in zip(batches, results, strict=True)
            if isinstance(r, errors.InvalidArgument)
        ]

    def _unpublished(self, batch: ReportBatch) -> errors.InvalidArgument | None:
        """Return why a batch names something never published, or None."""
        if self._catalog is None:
            return None
        for item in (*batch.models, *batch.installs):
            if not self._catalog.published(item.model, item.version, item.variant):
                return errors.InvalidArgument(
                    f"{item.model}:{item.version} ({item.variant}) was never published: a "
                    "device reports only what it was sent"
                )
        return None


def _still_wanted(future) -> bool:
    """Return False for a cancelled future (its call went away); mark the rest running."""
    if isinstance(future, asyncio.Future):
        return not future.done()  # a racy read, but a late cancel only wastes the store
    return future.set_running_or_notify_cancel()


def _settle(future, result) -> None:
    if isinstance(result, Exception):
        future.set_exception(result)
    else:
        future.set_result(result)


def _settle_all(settled: list) -> None:
    """Resolve a group's futures on their loop (skipping calls cancelled meanwhile)."""
    for future, result in settled:
        if not future.done():
            _settle(future, result)
