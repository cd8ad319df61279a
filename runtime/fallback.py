"""The fallback chain: which config a model runs with now, and what to do when it fails.

A `ConfigChain` holds the configs a model may use, best first. Exactly one is active.
When the active config fails to load, raises during inference, returns non-finite
outputs, or has crashed its worker `crash_limit` times in a row (a request it serves
resets the count, so rare crashes spread over weeks never add up), it is marked bad (for good: a
bad config is never retried in this model) and the next one is loaded and, when golden
data exists, checked against it before it serves. When none is left the chain is
failed: the caller should go back to the previous model version. Every step is a
`FallbackEvent` with its reason.

While a fallback loads the next config (seconds, under the lock) `active` is None;
readers that must not mistake that for failure use `wait_active()` or `failed`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

from runtime.backends import BackendConfig, Precision
from runtime.errors import InferenceError, InvalidInput, ModelLoadError
from runtime.events import CrashEvent, FallbackEvent
from runtime.golden import Golden
from runtime.probe import Executor, ProbeResult, probe_config, rank

__all__ = ["ConfigChain"]

logger = logging.getLogger("runtime")

VALIDATION_RUNS = 3  # checking a fallback config against golden data, on the request path
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
    ) -> None:
        self._make, self._golden, self._crash_limit = make, golden, max(1, crash_limit)
        self._lock = threading.Lock()
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
                kept = self._probe_one(config, kept, runs)
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
            elif ranked:
                self._activate_next()
            else:
                self.failure = "no candidate config passed the probe"

    def _probe_one(
        self, config: BackendConfig, kept: Executor | None, runs: int
    ) -> Executor | None:
        """Probe `config`; return whichever of it and `kept` is the best so far (loaded)."""
        if self._golden is None and config.precision not in _JUDGED_WITHOUT_GOLDEN:
            reason = f"{config.precision.name} precision needs golden data to be judged"
            self.probe_results.append(ProbeResult(config, None, False, error=reason))
            return kept
        result, executor = probe_config(self._make, config, self._golden, runs=runs)
        self.probe_results.append(result)
        if executor is None:
            return kept
        if rank(self.probe_results)[0] is result:  # the best so far: keep it loaded
            kept, executor = executor, kept
        if executor is not None:
            executor.close()
        return kept

    def start_forced(self, configs: Sequence[BackendConfig]) -> None:
        """Serve with the first of `configs` that loads (and matches the golden data)."""
        with self._lock:
            self._pending = list(_unique(configs))
            self._activate_next()

    @property
    def failed(self) -> bool:
        """Tell whether no config is left; False while a fallback is still loading one."""
        return self.failure is not None  # set only where the chain runs out, or closes

    def wait_active(self) -> Executor | None:
        """Return the active executor, waiting for a fallback in progress to finish."""
        with self._lock:
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
            self.active = None
            self._activate_next(failed.config, reason)
        failed.close()  # after the lock: it waits for requests still running on it

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
                self.active = None
                how = event.signal or event.reason
                self._activate_next(config, f"crashed {count} times, last: {how}")
        if retire:
            executor.close()
        return event

    def close(self) -> None:
        """Close the active executor; the chain serves nothing afterwards."""
        with self._lock:
            active, self.active, self._pending = self.active, None, []
            self.failure = self.failure or "closed"
        if active is not None:
            active.close()

    def _activate_next(self, failed: BackendConfig | None = None, reason: str = "") -> None:
        """Walk the pending configs until one loads and passes; caller holds the lock."""
        while failed is not None or self._pending:
            if failed is not None:
                following = self._pending[0] if self._pending else None
                self.fallbacks.append(FallbackEvent(failed, following, reason))
                target = following.key if following else "nothing"
                logger.warning("fallback from %s to %s: %s", failed.key, target, reason)
                failed = None
            if not self._pending:
                break
            config = self._pending.pop(0)
            executor, problem = self._load(config)
            if executor is not None:
                self.active = executor
                return
            failed, reason = config, problem
        self.failure = "no backend config left" + (f" (last: {reason})" if reason else "")

    def _load(self, config: BackendConfig) -> tuple[Executor | None, str]:
        """Load one config; with golden data, only keep it if the outputs match."""
        if self._golden is not None:
            result, executor = probe_config(
                self._make, config, self._golden, runs=VALIDATION_RUNS, warmup=0
            )
            self.probe_results.append(result)
            return executor, result.error or ""
        try:
            return self._make(config), ""
        except (ModelLoadError, InferenceError) as exc:
            return None, f"load failed: {exc}"


def _unique(configs: Sequence[BackendConfig]) -> list[BackendConfig]:
    """Drop repeated configs, keeping the first occurrence (order is preference)."""
    return list(dict.fromkeys(configs))
