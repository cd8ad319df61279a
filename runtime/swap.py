"""Hot swap: serve one model slot while a new version loads, switch without dropping.

A `ModelSlot` holds the version serving now. Loading a new version (`load`) happens in
the caller's thread, off the request path: requests keep going to the old version all
the while. The switch itself is one reference swap under a lock, so every request runs
entirely on one version, old or new. The old version is closed by whichever comes last:
the swap (if it was idle) or its last in-flight request, never under a request's feet.

Order. Loads take seconds and may run concurrently (a sync delivers v2, then v3 before
v2 finished loading), so they can finish in any order. Every swap carries a sequence
number and the slot only ever moves forward: a swap whose sequence is not above the
serving one is stale, refused with `StaleSwap`, and its model closed (the slot owns a
model once it is handed to `swap`). By default a swap's sequence is taken when it is
asked for: `load` takes it when called, before loading, so of two loads the one called
last wins whichever finishes first; `swap` takes it on the spot. A caller with its own
order (e.g. the control plane's revision) passes ``sequence=`` explicitly. Going back to
an older version is a new swap like any other: versions move only where the caller
says, in the order it said so. Swapping in the model already serving is a no-op (it is
not closed), apart from moving the slot's sequence forward.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from runtime.errors import ModelFailed, RuntimeFailure, StaleSwap
from runtime.model import Model

__all__ = ["ModelSlot"]

T = TypeVar("T")


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
        self._serving = 0  # sequence of the swap that installed the serving entry
        self._issued = 0  # highest sequence handed out or seen

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

    @property
    def sequence(self) -> int:
        """Return the sequence of the swap that put the serving version in place."""
        return self._serving

    def next_sequence(self) -> int:
        """Reserve a sequence above every one handed out so far (for a later `swap`)."""
        with self._lock:
            self._issued += 1
            return self._issued

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run on the serving version; see `Model.run`."""
        return self.run_versioned(inputs)[1]

    def run_versioned(self, inputs: Mapping[str, np.ndarray]) -> tuple[str, dict[str, np.ndarray]]:
        """Run on the serving version; return which version answered, and its outputs."""
        return self._on_serving(lambda model: (model.version, model.run(inputs)))

    def run_batch_versioned(
        self, batch: Sequence[Mapping[str, np.ndarray]]
    ) -> tuple[str, list[dict[str, np.ndarray] | RuntimeFailure]]:
        """Run a batch on the serving version (see `Model.run_batch`); say which answered."""
        return self._on_serving(lambda model: (model.version, model.run_batch(batch)))

    async def run_versioned_async(
        self, inputs: Mapping[str, np.ndarray]
    ) -> tuple[str, dict[str, np.ndarray]]:
        """`run_versioned` for a caller on an asyncio loop (see `Model.run_async`)."""
        entry = self._enter()
        try:
            return entry.model.version, await entry.model.run_async(inputs)
        finally:
            if self._leave(entry):  # closing a worker may wait for it: not on the loop
                await asyncio.get_running_loop().run_in_executor(None, entry.model.close)

    def _on_serving(self, call: Callable[[Model], T]) -> T:
        """Return `call(serving version)`; the version is not closed before it returns."""
        entry = self._enter()
        try:
            return call(entry.model)
        finally:
            if self._leave(entry):
                entry.model.close()

    def _enter(self) -> _Entry:
        """Count a request in on the serving version; return its entry."""
        with self._lock:
            entry = self._entry
            if entry is None:
                raise ModelFailed("no model version is loaded in this slot")
            entry.inflight += 1
        return entry

    def _leave(self, entry: _Entry) -> bool:
        """Count a request out; tell whether it was the last on a retired version (close it)."""
        with self._lock:
            entry.inflight -= 1
            return entry.retired and entry.inflight == 0

    def swap(
        self, model: Model, *, sequence: int | None = None, close_idle: bool = True
    ) -> Model | None:
        """Make `model` serve from now on; close the old one once its requests finish.

        The slot owns `model` from here on. Raises StaleSwap (after closing `model`) if
        a swap with a higher `sequence` (default: a fresh one, see the module docstring)
        already happened; swapping in the serving model changes nothing. With
        `close_idle=False` an old version with no request in flight is returned instead
        of closed, for the caller to close outside its own locks (stopping a worker
        takes a while); otherwise None is returned.
        """
        with self._lock:
            if sequence is None:
                self._issued += 1
                sequence = self._issued
            self._issued = max(self._issued, sequence)
            serving = self._serving
            if self._entry is not None and self._entry.model is model:
                self._serving = max(serving, sequence)
                return None
            if sequence > serving:
                old, self._entry, self._serving = self._entry, _Entry(model), sequence
                drained = _retire(old)
        if sequence <= serving:
            model.close()
            name = model.version or "(unversioned)"
            raise StaleSwap(
                f"swap to {name} (sequence {sequence}) is stale: sequence {serving} serves",
                sequence,
                serving,
            )
        if drained is not None and close_idle:
            drained.close()
            return None
        return drained

    def load(
        self, data: bytes, *, version: str, sequence: int | None = None, **options: Any
    ) -> Model:
        """Load `data` as `version` (see `Model.from_bytes`) while serving, then swap.

        The swap's sequence is taken now, before loading (or given as `sequence`). If the
        new version fails to start (ModelFailed), the old one keeps serving; if a later
        swap got in first, StaleSwap is raised and the loaded model closed.
        """
        if sequence is None:
            sequence = self.next_sequence()
        model = Model.from_bytes(data, version=version, **options)
        self.swap(model, sequence=sequence)
        return model

    def close(self) -> None:
        """Stop serving: the current version closes once its requests finish.

        Swaps sequenced before this call are stale from now on; later ones serve again.
        """
        with self._lock:
            old, self._entry = self._entry, None
            self._serving = self._issued = self._issued + 1
            drained = _retire(old)
        if drained:
            drained.close()


def _retire(entry: _Entry | None) -> Model | None:
    """Mark `entry` retired (caller holds the lock); return its model if idle, to close."""
    if entry is None:
        return None
    entry.retired = True
    return entry.model if entry.inflight == 0 else None
