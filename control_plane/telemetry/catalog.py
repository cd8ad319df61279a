"""What has been published: the only model versions a device's report may speak of.

Every (model, version, variant) a report names becomes rollup rows and device rows; a
device naming made-up ones would fill the database and slow every roll. Reports are
checked against the published set, held in memory and read again when a report names
something not in it (a version published since), at most once every RELOAD_S. Between
reloads a miss is looked up on its own (one indexed read of that version): a version
published just after a reload is known at once, and a device naming made-up versions
costs one small read a report, never a read of the whole set.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from contract import errors
from control_plane.store.base import RegistryStore

RELOAD_S = 1.0


class Catalog:
    """The published (model, version, variant) triples, cached. Thread-safe."""

    def __init__(
        self, store: RegistryStore, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store, self._clock = store, clock
        self._lock = threading.Lock()
        self._known: frozenset[tuple[str, int, str]] = frozenset()
        self._loaded_at = float("-inf")

    def published(self, model: str, version: int, variant: str) -> bool:
        """Return whether that variant of that version was published."""
        key = (model, version, variant)
        if key in self._known:
            return True
        with self._lock:
            if key in self._known:
                return True
            if self._clock() - self._loaded_at >= RELOAD_S:
                self._known = self._store.published_variants()
                self._loaded_at = self._clock()
                return key in self._known
            try:
                record = self._store.get_version(model, version)
            except (errors.NotFound, errors.InvalidArgument):
                return False
            if record.variant(variant) is None:
                return False
            self._known = self._known | {key}
            return True
