"""The models this device serves: one hot-swappable slot per model, with its stats.

Each installed model serves from a `runtime.ModelSlot`. A newly activated version is
swapped in between requests (none fails because of an install). Every request is
counted for telemetry (device_agent.report_outbox.Collector). When the active version keeps
failing at run time, its fallback chain exhausted (`ModelFailed`) or its worker crashing
`ROLLBACK_CRASHES` times in a row, `on_failure(model, uid, reason)` is called once for
that version (`uid`); the agent goes back to the previous version if that one is still
active. Failures of a version already swapped out count for nothing.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from device_agent.report_outbox import Collector

TYPE_CHECKING = False  # not typing's: nothing below is needed at run time
if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("skiff.agent")

ROLLBACK_CRASHES = 3


class NotServing(Exception):
    """The model is not installed here, or is still loading (`loading`)."""

    def __init__(self, message: str, *, loading: bool = False) -> None:
        super().__init__(message)
        self.loading = loading


@dataclass
class _Served:
    slot: object  # runtime.ModelSlot
    # Runtime version string ("name:version") -> the install pointer slot it came from.
    infos: dict[str, dict] = field(default_factory=dict)
    crashes_in_row: int = 0
    failing: bool = False
    # runtime.Model -> (crashes, fallbacks, idle deaths) already reported.
    seen: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)


class Serving:
    """Serve installed models; thread-safe."""

    def __init__(
        self,
        collector: Collector,
        on_failure: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self._collector = collector
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._served: dict[str, _Served] = {}
        self._loading: set[str] = set()

    # -- what serves ------------------------------------------------------------------------

    def loading(self, name: str, loading: bool = True) -> None:
        """Mark `name` as being loaded (requests get "loading" instead of "not installed")."""
        with self._lock:
            if loading:
                self._loading.add(name)
            else:
                self._loading.discard(name)

    def put(self, name: str, info: dict, model) -> None:
        """Serve `model` (a runtime.Model, now owned here) for `name` from now on."""
        from runtime import ModelSlot

        with self._lock:
            served = self._served.get(name)
            if served is None:
                served = self._served[name] = _Served(ModelSlot())
            self._loading.discard(name)
            old = served.slot.model
            # Keep what in-flight requests on the old version still need, nothing older.
            keep = {model.version, old.version} if old is not None else {model.version}
            served.infos = {k: v for k, v in served.infos.items() if k in keep}
            served.infos[model.version] = info
            served.crashes_in_row, served.failing = 0, False
            # Under the lock: a drop() cannot slip in and orphan the new version.
            if old is not None and old is not model:
                self._take_events(name, served, old, locked=True)
            retired = served.slot.swap(model, close_idle=False)
        if retired is not None:
            # Stopping its worker takes a while: neither under the lock every request takes
            # nor on the activation's path (the install's outcome is still to be queued).
            closer = threading.Thread(target=retired.close, name="skiff-retire", daemon=True)
            closer.start()
        log.info("%s v%d serving on %s", name, info["version"], info.get("config") or "?")

    def drop(self, name: str) -> None:
        """Stop serving `name` (in-flight requests finish first)."""
        with self._lock:
            served = self._served.pop(name, None)
            self._loading.discard(name)
            if served is not None and served.slot.model is not None:
                self._take_events(name, served, served.slot.model, locked=True)
        if served is not None:
            served.slot.close()

    def close(self) -> None:
        """Stop serving everything."""
        for name in list(self._served):
            self.drop(name)

    def serving(self, name: str) -> dict | None:
        """Return the pointer slot of the version serving `name` now (None if none)."""
        with self._lock:
            served = self._served.get(name)
        model = served.slot.model if served else None
        return served.infos.get(model.version) if model is not None else None

    def current(self, name: str) -> tuple[dict, object] | None:
        """Return the pointer slot and the runtime.Model serving `name` now (None if none)."""
        with self._lock:
            served = self._served.get(name)
            model = served.slot.model if served else None
            info = served.infos.get(model.version) if model is not None else None
        return (info, model) if info is not None else None

    def is_loading(self, name: str) -> bool:
        """Return whether `name` is being loaded (installed, not serving yet)."""
        with self._lock:
            return name in self._loading

    def names(self) -> list[str]:
        """Return the models being served."""
        with self._lock:
            return sorted(self._served)

    # -- requests ----------------------------------------------------------------------------

    def infer(
        self, name: str, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict, str, dict[str, np.ndarray], int]:
        """Run `name`'s serving version; return its pointer slot, config, outputs, latency (ns).

        Raises NotServing, or the runtime's errors (InvalidInput for bad inputs).
        """
        served = self._served_now(name)
        start = time.perf_counter_ns()
        model = served.slot.model
        with self._failures_counted(name, served, model, start):
            version, outputs = served.slot.run_versioned(inputs)
        return self._answered(name, served, model, version, outputs, _since(start))

    async def infer_async(
        self, name: str, inputs: Mapping[str, np.ndarray]
    ) -> tuple[dict, str, dict[str, np.ndarray], int]:
        """`infer` for a caller on the agent's event loop (no thread hop in the common case)."""
        served = self._served_now(name)
        start = time.perf_counter_ns()
        model = served.slot.model
        with self._failures_counted(name, served, model, start):
            version, outputs = await served.slot.run_versioned_async(inputs)
        return self._answered(name, served, model, version, outputs, _since(start))

    @contextlib.contextmanager
    def _failures_counted(self, name: str, served: _Served, model, start: int):
        """Count a request's failure against its version (a caller's bad input is not one)."""
        from runtime import InvalidInput, RuntimeFailure

        try:
            yield
        except InvalidInput:
            raise  # the caller's inputs: not the version's fault, not counted
        except RuntimeFailure as exc:
            self._count(name, served.infos.get(model.version), model, _since(start), False)
            self._failed(name, served, model, exc)
            raise

    def _answered(self, name: str, served: _Served, model, version: str, outputs, ns: int):
        """Count a request that `version` answered; return what `infer` returns."""
        with self._lock:
            served.crashes_in_row = 0
            info = served.infos[version]
        answered = model if model.version == version else served.slot.model or model
        config = self._count(name, info, answered, ns, True)
        return info, config, outputs, ns

    def infer_batch(
        self, name: str, batch: Sequence[Mapping[str, np.ndarray]]
    ) -> tuple[dict, str, list[dict[str, np.ndarray] | Exception]]:
        """Run a batch on `name`'s serving version in one go (`runtime.Model.run_batch`).

        Returns the pointer slot and config of the version that answered, and per item
        its outputs or its error (the runtime's, as `infer` would raise them). Each item
        counts as one request. Raises NotServing.
        """
        from runtime import InvalidInput, RuntimeFailure

        served = self._served_now(name)
        start = time.perf_counter_ns()
        model = served.slot.model
        try:
            version, answers = served.slot.run_batch_versioned(batch)
        except RuntimeFailure as exc:  # no version in the slot: every item fails alike
            version, answers = model.version, [exc] * len(batch)
        share = _since(start) // max(len(batch), 1)
        with self._lock:
            info = served.infos.get(version)
            if any(not isinstance(a, RuntimeFailure) for a in answers):
                served.crashes_in_row = 0
        answered = model if model.version == version else served.slot.model or model
        config = ""
        for answer in answers:
            if not isinstance(answer, RuntimeFailure):
                config = self._count(name, info, answered, share, True)
            elif not isinstance(answer, InvalidInput):  # the caller's inputs: not counted
                self._count(name, info, answered, share, False)
        # One crash fails every item it interrupted: it counts once toward a rollback.
        failures = [a for a in answers if isinstance(a, RuntimeFailure)]
        for exc in {id(e): e for e in failures if not isinstance(e, InvalidInput)}.values():
            self._failed(name, served, answered, exc)
        return info or {}, config, answers

    def _served_now(self, name: str) -> _Served:
        """Return what serves `name`; NotServing if nothing does (yet)."""
        with self._lock:
            served = self._served.get(name)
            loading = name in self._loading
        if served is None or served.slot.model is None:
            if loading:
                raise NotServing(f"model {name} is loading: try again shortly", loading=True)
            raise NotServing(f"model {name} is not installed on this device")
        return served

    def _failed(self, name: str, served: _Served, model, exc: Exception) -> None:
        """Note a version's failure; ask for a rollback once it keeps failing."""
        from runtime import ModelFailed, WorkerCrashed

        info = served.infos.get(model.version)
        reason = ""
        with self._lock:
            if served.slot.model is not model:
                pass  # a version already swapped out: its failures count for nothing
            elif isinstance(exc, WorkerCrashed):
                served.crashes_in_row += 1
                if served.crashes_in_row >= ROLLBACK_CRASHES:
                    reason = f"worker crashed {served.crashes_in_row} times in a row: {exc}"
            elif isinstance(exc, ModelFailed):
                reason = f"no backend config left: {exc}"
            if reason and served.failing:
                reason = ""  # asked once already
            if reason:
                served.failing = True
        if reason and self._on_failure is not None and info is not None:
            self._on_failure(name, info["uid"], reason.splitlines()[0][:500])

    def _count(self, name: str, info: dict | None, model, ns: int, ok: bool) -> str:
        """Count one request; return the backend config it ran on."""
        if info is None:
            return ""
        config = model.config.key if model.config is not None else info.get("config", "")
        self._collector.inference((name, info["version"], info["variant"], config), ns, ok)
        return config

    # -- telemetry ---------------------------------------------------------------------------

    def collect_events(self) -> None:
        """Hand the runtime's new crash and fallback events to the collector."""
        with self._lock:
            items = list(self._served.items())
        for name, served in items:
            model = served.slot.model
            if model is not None:
                self._take_events(name, served, model)

    def _take_events(self, name: str, served: _Served, model, *, locked: bool = False) -> None:
        info = served.infos.get(model.version)
        if info is None:
            return
        crashes, fallbacks, idle = model.crashes, model.fallbacks, model.idle_deaths
        if not locked:
            self._lock.acquire()
        try:
            seen = served.seen.get(model, (0, 0, 0))
            served.seen[model] = (len(crashes), len(fallbacks), len(idle))
        finally:
            if not locked:
                self._lock.release()
        new_crashes = list(crashes[seen[0] :]) + list(idle[seen[2] :])
        config = model.config.key if model.config is not None else info.get("config", "")
        key = (name, info["version"], info["variant"], config)
        self._collector.events(key, new_crashes, list(fallbacks[seen[1] :]))

    def status(self) -> dict[str, dict]:
        """Return, per served model, its version, config and runtime state."""
        out = {}
        with self._lock:
            items = list(self._served.items())
        for name, served in items:
            model = served.slot.model
            info = served.infos.get(model.version) if model is not None else None
            out[name] = {
                "version": info["version"] if info else 0,
                "config": (model.config.key if model and model.config else ""),
                "state": model.state if model is not None else "closed",
            }
        return out


def _since(start: int) -> int:
    return time.perf_counter_ns() - start
