"""The fallback chain: which config a model runs with now, and what to do when it fails.

A `ConfigChain` holds the configs a model may use, best first. Exactly one is active.
When the active config fails to load, raises during inference, returns non-finite
outputs, or has crashed its worker `crash_limit` times in a row (a request it serves
resets the count, so rare crashes spread over weeks never add up), it is marked bad (for good: a
bad config is never retried in this model) and the next one is loaded and, when golden
data exists, checked against it before it serves. When none is left the chain is
failed: the caller should go back to the previous model version. Every step is a
`FallbackEvent` with its reason.

Loading the next config takes seconds (minutes with GPU tuning), so it never happens
under the lock that guards the chain's state: that lock is only held for a few field
updates, and status reads (`active`, `state`, the event lists) never wait for a load.
While a fallback loads, `active` is None and `state` is "loading"; requests wait for the
outcome with `wait_active(timeout)`, which raises DeadlineExceeded when it takes longer.
The thread that found the failure does the loading (one at a time: only the thread that
took the failed executor out of `active` walks on).

A chain started on one config (`start_forced`) can finish its probe while it serves
(`probe_rest`): the other candidates are loaded and timed beside the serving executor,
a faster one replaces it in one swap, and the ranked results become the chain.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Mapping, Sequence

from runtime.backends import Backend, BackendConfig, Precision
from runtime.errors import DeadlineExceeded, InferenceError, InvalidInput, ModelLoadError
from runtime.events import CrashEvent, FallbackEvent
from runtime.golden import Golden
from runtime.probe import Executor, ProbeResult, measure, probe_config, rank

__all__ = ["ConfigChain"]

logger = logging.getLogger("runtime")

VALIDATION_RUNS = 3  # checking a fallback config against golden data, on the request path

# Backends this process found MNN does not have (it ran their configs on another one),
# with the backend it ran instead. The MNN build and the device do not change under a
# running process, so one probe per backend is enough: later configs of the same
# backend, in this model or any later one, are refused without loading the model again.
_UNAVAILABLE: dict[Backend, Backend] = {}
_UNAVAILABLE_LOCK = threading.Lock()
# Only golden data can tell whether reduced precision is accurate enough for a model.
_JUDGED_WITHOUT_GOLDEN = (Precision.NORMAL, Precision.HIGH)


class ConfigChain:
    """The active executor of one model, the configs left, and the history of both."""

    def __init__(
        self,
        make: Callable[[BackendConfig], Executor],
        golden: Golden | None,
        *,
        crash_limit: int,
        input_shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        """Prepare a chain loading configs with `make`; `start_*` picks the first one.

        `input_shapes` sizes dynamic dims for probing without golden data (see
        `runtime.probe.synthetic_inputs`).
        """
        self._make, self._golden, self._crash_limit = make, golden, max(1, crash_limit)
        self._input_shapes = dict(input_shapes or {})
        self._lock = threading.Lock()  # state only: never held while loading
        self._changed = threading.Condition(self._lock)  # a load finished, or the chain closed
        self._loading = False
        self._closed = False
        self._probing = 0  # `probe_rest` calls running: they may still load from the model
        self._after_probing: list[Callable[[], None]] = []
        self._pending: list[BackendConfig] = []
        self.active: Executor | None = None
        self.failure: str | None = None
        self.fallbacks: list[FallbackEvent] = []
        self.crashes: list[CrashEvent] = []
        self.probe_results: list[ProbeResult] = []
        self._crash_counts: dict[BackendConfig, int] = {}

    def start_probed(self, candidates: Sequence[BackendConfig], *, runs: int) -> None:
        """Probe every candidate, then serve with the fastest accepted one.

        Only the best executor so far stays loaded, so probing needs memory for two
        copies of the model, not one per candidate. Without golden data, low-precision
        candidates are skipped (recorded as refused): nothing could check their accuracy.
        """
        kept: Executor | None = None
        try:
            for config in _unique(candidates):
                kept = self._probe_one(config, kept, runs, self.probe_results)
        except BaseException:
            if kept is not None:
                kept.close()  # e.g. interrupted mid-probe: no executor may outlive this
            raise
        ranked = [r.config for r in rank(self.probe_results)]
        if kept is not None and kept.config != ranked[0]:
            kept.close()  # a later result moved the bar: load the winner again
            kept = None
        with self._lock:
            self._pending = ranked
            if kept is not None:
                self.active, self._pending = kept, ranked[1:]
                return
            if not ranked:
                self.failure = "no candidate config passed the probe"
                return
            self._loading = True
        # Every pending config was probed just now: loading the winner again (or the next
        # one, should it fail to) validates it without adding a second probe result.
        self._advance(record=False)

    def probe_rest(
        self,
        candidates: Sequence[BackendConfig],
        *,
        runs: int,
        stop: threading.Event | None = None,
    ) -> list[ProbeResult]:
        """Probe `candidates` while the active config serves; switch to a faster one.

        For a chain started on one config (`start_forced`, e.g. the config the model's
        previous version won with): the serving executor is timed on the same inputs as
        each candidate, and a candidate faster beyond timing noise (`rank`) takes over in
        one swap; requests already running on the old executor finish there. The accepted
        results, fastest first, become the fallback chain. Configs this chain has already
        marked bad are not tried again. Only the best candidate so far stays loaded, so
        this needs memory for three copies of the model (serving, best, probing).

        Returns this round's results, the serving config's first. Nothing is switched if
        the serving executor changes meanwhile (a fallback), the chain closes or `stop`
        is set; then the round stops after the probe in progress.
        """
        with self._lock:
            serving = self.active
            if serving is None or self._closed:
                return []
            self._probing += 1
        kept: Executor | None = None
        results: list[ProbeResult] = []
        try:
            results.append(
                measure(serving, self._golden, runs=runs, input_shapes=self._input_shapes)
            )
            bad = {event.from_config for event in self.fallbacks}
            for config in _unique(candidates):
                if not results[0].accepted or self._closed or self.active is not serving:
                    break  # it failed or was replaced meanwhile: this round is moot
                if stop is not None and stop.is_set():
                    return results
                if config != serving.config and config not in bad:
                    kept = self._probe_one(config, kept, runs, results)
            kept = self._take_faster(serving, kept, results)
        finally:
            if kept is not None:
                kept.close()
            with self._lock:
                self._probing -= 1
                after = self._after_probing if not self._probing else []
                self._after_probing = [] if not self._probing else self._after_probing
            for then in after:
                then()
        return results

    def _take_faster(
        self, serving: Executor, kept: Executor | None, results: list[ProbeResult]
    ) -> Executor | None:
        """Make `kept` active if it ranks first and `serving` still serves; return what to close."""
        order = [r.config for r in rank(results)]
        with self._lock:
            if self.active is not serving or self._closed or not order:
                return kept
            switch = kept is not None and order[0] == kept.config
            if switch:
                self.active, kept = kept, serving
            self._pending = [c for c in order if c != self.active.config]
        if switch:
            logger.info("switching from %s to the faster %s", serving.config.key, order[0].key)
        return kept  # the old executor: closing it waits for requests still running on it

    def _probe_one(
        self,
        config: BackendConfig,
        kept: Executor | None,
        runs: int,
        results: list[ProbeResult],
    ) -> Executor | None:
        """Probe `config`; return whichever of it and `kept` ranks best in `results` (loaded).

        The result is added to `results` (and to `probe_results`, if that is another list).
        """
        if self._golden is None and config.precision not in _JUDGED_WITHOUT_GOLDEN:
            reason = f"{config.precision.name} precision needs golden data to be judged"
            self._add(results, ProbeResult(config, None, False, error=reason))
            return kept
        with _UNAVAILABLE_LOCK:
            instead = _UNAVAILABLE.get(config.backend)
        if instead is not None:
            reason = (
                f"{config.backend.name} is not available here: MNN runs its configs on "
                f"{instead.name} (found by an earlier probe)"
            )
            self._add(results, ProbeResult(config, instead, False, error=reason))
            return kept
        result, executor = probe_config(
            self._make, config, self._golden, runs=runs, input_shapes=self._input_shapes
        )
        if not result.accepted and result.actual_backend not in (None, config.backend):
            with _UNAVAILABLE_LOCK:
                _UNAVAILABLE[config.backend] = result.actual_backend
        self._add(results, result)
        if executor is None:
            return kept
        if rank(results)[0] is result:  # the best so far: keep it loaded
            kept, executor = executor, kept
        if executor is not None:
            executor.close()
        return kept

    def _add(self, results: list[ProbeResult], result: ProbeResult) -> None:
        results.append(result)
        if results is not self.probe_results:
            self.probe_results.append(result)

    def start_forced(self, configs: Sequence[BackendConfig]) -> None:
        """Serve with the first of `configs` that loads (and matches the golden data)."""
        with self._lock:
            self._pending = list(_unique(configs))
            self._loading = True
        self._advance()

    @property
    def failed(self) -> bool:
        """Tell whether no config is left; False while a fallback is still loading one."""
        return self.failure is not None  # set only where the chain runs out, or closes

    @property
    def state(self) -> str:
        """Return "serving", "loading" (a fallback is loading a config) or "failed"."""
        if self.failure is not None:
            return "failed"
        return "loading" if self._loading else "serving"

    def wait_active(self, timeout: float | None = None) -> Executor | None:
        """Return the active executor, waiting up to `timeout` s for a load in progress.

        Returns None once the chain failed; raises DeadlineExceeded if the load is
        still going at the timeout (None: wait as long as it takes).
        """
        with self._changed:
            if not self._changed.wait_for(lambda: not self._loading, timeout):
                raise DeadlineExceeded(
                    f"the model is loading its next backend config (a fallback) and was "
                    f"not ready within {timeout:g} s"
                )
            return self.active

    def vouches_for(self, executor: Executor) -> bool:
        """Tell whether `executor` still matches the golden data (False without any).

        Used when a request gives non-finite outputs: a config that still gets the
        golden inputs right is not what is wrong, the request's inputs are.
        """
        if self._golden is None:
            return False
        try:
            arrays, exact = executor.signature.check(self._golden.inputs)
            return self._golden.compare(executor.run(arrays, exact)).accepted
        except (InferenceError, InvalidInput):
            return False

    def fall_back(self, failed: Executor, reason: str) -> None:
        """Mark `failed`'s config bad and activate the next one (no-op if already done)."""
        with self._lock:
            if self.active is not failed:
                return  # another request already moved the chain on
            self.active, self._loading = None, True
        self._advance(failed.config, reason)
        failed.close()  # last: it waits for requests still running on it

    def record_success(self, config: BackendConfig) -> None:
        """Reset `config`'s crash count: it served a request since it last crashed."""
        if self._crash_counts.get(config):  # a dict read on the hot path, nothing more
            with self._lock:
                self._crash_counts.pop(config, None)

    def record_crash(self, executor: Executor, event: CrashEvent) -> CrashEvent:
        """Count a worker crash; fall back once the config crashed `crash_limit` times in a row.

        The event's ``count`` is the number of consecutive crashes, this one included.
        """
        config = executor.config
        with self._lock:
            count = self._crash_counts[config] = self._crash_counts.get(config, 0) + 1
            event = dataclasses.replace(event, count=count)
            self.crashes.append(event)
            retire = count >= self._crash_limit and self.active is executor
            if retire:
                self.active, self._loading = None, True
        if retire:
            how = event.signal or event.reason
            self._advance(config, f"crashed {count} times, last: {how}")
            executor.close()
        return event

    def close(self, then: Callable[[], None] | None = None) -> None:
        """Close the active executor; the chain serves nothing afterwards.

        `then` is called once nothing loads from the model any more: at once, or when a
        `probe_rest` still running ends (the model's memfd must outlive its loads).
        """
        with self._lock:
            active, self.active, self._pending = self.active, None, []
            self.failure = self.failure or "closed"
            self._closed = True
            self._changed.notify_all()
            if then is not None and self._probing:
                self._after_probing.append(then)
                then = None
        try:
            if active is not None:
                active.close()
        finally:
            if then is not None:
                then()

    def _advance(
        self, failed: BackendConfig | None = None, reason: str = "", *, record: bool = True
    ) -> None:
        """Walk the pending configs until one loads and passes, and make it active.

        The caller set `_loading` (and took the failed executor out of `active`) under
        the lock; the loads themselves run without it. With `record`, each load's
        validation is added to `probe_results`.
        """
        executor = None
        while executor is None:
            with self._lock:
                if failed is not None:
                    self._record_fallback(failed, reason)
                    failed = None
                if not self._pending or self._closed:
                    break
                config = self._pending.pop(0)
            executor, problem = self._load(config, record=record)
            if executor is None:
                failed, reason = config, problem
        with self._lock:
            self._loading = False
            if executor is not None and not self._closed:
                self.active, executor = executor, None
            elif self.failure is None:
                self.failure = "no backend config left" + (f" (last: {reason})" if reason else "")
            self._changed.notify_all()
        if executor is not None:  # the chain closed while it loaded
            executor.close()

    def _record_fallback(self, failed: BackendConfig, reason: str) -> None:
        """Record (and log) moving on from `failed`; caller holds the lock."""
        following = self._pending[0] if self._pending else None
        self.fallbacks.append(FallbackEvent(failed, following, reason))
        target = following.key if following else "nothing"
        logger.warning("fallback from %s to %s: %s", failed.key, target, reason)

    def _load(self, config: BackendConfig, *, record: bool) -> tuple[Executor | None, str]:
        """Load one config; with golden data, only keep it if the outputs match."""
        if self._golden is not None:
            result, executor = probe_config(
                self._make, config, self._golden, runs=VALIDATION_RUNS, warmup=0
            )
            if record:
                self.probe_results.append(result)
            return executor, result.error or ""
        try:
            return self._make(config), ""
        except (ModelLoadError, InferenceError) as exc:
            return None, f"load failed: {exc}"


def _unique(configs: Sequence[BackendConfig]) -> list[BackendConfig]:
    """Drop repeated configs, keeping the first occurrence (order is preference)."""
    return list(dict.fromkeys(configs))
