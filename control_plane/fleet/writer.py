"""Write-behind for what devices report on every call (last_seen, attributes, states).

A Sync must not wait on a database commit: on SQLite every commit is a serialised,
fsynced write, and with 100k devices `last_seen` alone would be thousands of writes a
second. Updates are coalesced per device in memory and written in one transaction every
`interval_s`; a crash loses at most that much `last_seen`, never desired state (which is
derived, not stored).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import replace

from contract import errors
from control_plane.store.fleet import DeviceUpdate, FleetStore

log = logging.getLogger(__name__)


def _merge(old: DeviceUpdate, new: DeviceUpdate) -> DeviceUpdate:
    """Combine two updates of one device: the newer value of each field wins."""
    return replace(
        new,
        attributes=new.attributes if new.attributes is not None else old.attributes,
        installed=new.installed if new.installed is not None else old.installed,
        synced=new.synced if new.synced is not None else old.synced,
    )


class DeviceWriter:
    """Coalesces device updates and flushes them in batches from a background thread."""

    def __init__(self, store: FleetStore, *, interval_s: float = 0.5) -> None:
        self._store = store
        self._interval = interval_s
        self._pending: dict[str, DeviceUpdate] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="skiff-writer", daemon=True)

    def start(self) -> None:
        """Start the background flusher."""
        self._thread.start()

    def add(self, update: DeviceUpdate) -> None:
        """Queue one device's update (cheap: a dict operation under a lock)."""
        with self._lock:
            old = self._pending.get(update.device_id)
            self._pending[update.device_id] = update if old is None else _merge(old, update)

    def flush(self) -> None:
        """Write everything queued so far (reads that must see it call this first)."""
        with self._flush_lock:
            with self._lock:
                batch, self._pending = list(self._pending.values()), {}
            if not batch:
                return
            try:
                self._store.apply_device_updates(batch)
            except errors.Unavailable:
                # Put the batch back (newer updates win) and let the next flush retry.
                with self._lock:
                    for u in batch:
                        newer = self._pending.get(u.device_id)
                        self._pending[u.device_id] = u if newer is None else _merge(u, newer)
                raise
            except errors.SkiffError:
                self._apply_one_by_one(batch)

    def _apply_one_by_one(self, batch: list[DeviceUpdate]) -> None:
        """Write a batch that failed as a whole row by row, dropping the rows that fail.

        One device's unwritable report must not stop every other device's from being
        written (and it would fail again on every retry).
        """
        for u in batch:
            try:
                self._store.apply_device_updates([u])
            except errors.Unavailable:
                self.add(u)
            except errors.SkiffError as exc:
                log.warning("dropped the report of device %s: %s", u.device_id, exc)

    def close(self) -> None:
        """Stop the flusher and write what is left."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.flush()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.flush()
            except errors.SkiffError as exc:
                log.warning("device updates not written yet (%s); will retry", exc)
