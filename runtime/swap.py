"""Hot swap: serve one model slot while a new version loads, switch without dropping.

A `ModelSlot` holds the version serving now. Loading a new version (`load`) happens in
the caller's thread, off the request path: requests keep going to the old version all
the while. The switch itself is one reference swap under a lock, so every request runs
entirely on one version, old or new. The old version is closed by whichever comes last:
the swap (if it was idle) or its last in-flight request, never under a request's feet.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.errors import ModelFailed
from runtime.model import Model

__all__ = ["ModelSlot"]


@dataclass(eq=False)
class _Entry:
    """One version in the slot, with how many requests are running on it."""

    model: Model
    inflight: int = 0
    retired: bool = False


class ModelSlot:
    """The serving version of one model, swappable while requests run. Thread-safe."""

    def __init__(self, model: Model | None = None) -> None:
        """Start with `model` serving (or nothing, until the first `swap` or `load`)."""
        self._lock = threading.Lock()
        self._entry = _Entry(model) if model is not None else None

    @property
    def model(self) -> Model | None:
        """Return the version serving now."""
        entry = self._entry
        return entry.model if entry else None

    @property
    def version(self) -> str | None:
        """Return the version string of the model serving now."""
        entry = self._entry
        return entry.model.version if entry else None

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on the serving version; see `Model.run`."""
        return self.run_versioned(inputs)[1]

    def run_versioned(self, inputs: Mapping[str, np.ndarray]) -> tuple[str, dict[str, np.ndarray]]:
        """Run on the serving version; return which version answered, and its outputs."""
        with self._lock:
            entry = self._entry
            if entry is None:
                raise ModelFailed("no model version is loaded in this slot")
            entry.inflight += 1
        try:
            return entry.model.version, entry.model.run(inputs)
        finally:
            with self._lock:
                entry.inflight -= 1
                drained = entry.retired and entry.inflight == 0
            if drained:
                entry.model.close()

    def swap(self, model: Model) -> None:
        """Make `model` serve from now on; close the old one once its requests finish."""
        self._replace(_Entry(model))

    def load(self, data: bytes, *, version: str, **options: Any) -> Model:
        """Load `data` as `version` (see `Model.from_bytes`) while serving, then swap.

        If the new version fails to start (ModelFailed), the old one keeps serving.
        """
        model = Model.from_bytes(data, version=version, **options)
        self.swap(model)
        return model

    def close(self) -> None:
        """Stop serving: the current version closes once its requests finish."""
        self._replace(None)

    def _replace(self, entry: _Entry | None) -> None:
        """Install `entry` atomically; retire the old one, closing it now if idle."""
        with self._lock:
            old, self._entry = self._entry, entry
            if old is not None:
                old.retired = True
            drained = old is not None and old.inflight == 0
        if drained:
            old.model.close()
