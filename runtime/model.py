"""`Model`: one model version, loaded from bytes, run with named numpy inputs.

The public entry point for inference on the device::

    model = Model.from_bytes(decrypted, golden=golden, isolation=Isolation.WORKER)
    outputs = model.run({"x": x})          # {"y": array(...)}

`from_bytes` puts the plaintext in a sealed memfd (never on disk), picks a backend
config (probing the candidates against the golden data, or taking one forced from
outside, e.g. the fleet's recommendation) and loads the model with it, in this process
or in a crash-isolated worker. `run` validates the inputs, runs them, checks the
outputs are finite, records the latency, and moves along the fallback chain when the
config fails. Everything that happened (probe results, fallbacks, crashes, latency
histogram) is data in `telemetry()`.

One request never walks the whole chain: a bad config costs at most one fallback per
request, and non-finite outputs from a config that still matches the golden data (or
from the replacement as well) are blamed on the inputs. Otherwise one odd input could
mark every config bad and roll the fleet back.
"""

from __future__ import annotations

import enum
import math
import os
import re
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from runtime._memfd import fd_path, sealed_memfd
from runtime.backends import DEFAULT_CONFIG, Backend, BackendConfig, candidate_configs
from runtime.errors import (
    ExecutorClosed,
    InferenceError,
    InvalidInput,
    ModelFailed,
    ModelLoadError,
    WorkerCrashed,
)
from runtime.events import CrashEvent, FallbackEvent
from runtime.fallback import ConfigChain
from runtime.golden import Golden
from runtime.histogram import LatencyHistogram
from runtime.probe import Executor, ProbeResult
from runtime.signature import Signature
from runtime.worker import DEFAULT_DEADLINE_S, Fault

__all__ = ["Isolation", "Model"]

_now = time.perf_counter_ns
DEFAULT_PROBE_RUNS = 10
DEFAULT_CRASH_LIMIT = 3


class Isolation(enum.Enum):
    """Where MNN runs: in the caller's process (fastest) or a worker (crash-contained)."""

    IN_PROCESS = "in_process"
    WORKER = "worker"


class Model:
    """A loaded model version. Thread-safe; use `from_bytes` to make one."""

    def __init__(
        self, fd: int, chain: ConfigChain, *, version: str, isolation: Isolation, check_finite: bool
    ) -> None:
        """Wrap a started chain; `from_bytes` is the way to build one."""
        self._fd, self._chain = fd, chain
        self.version, self.isolation = version, isolation
        self._check_finite = check_finite
        self.histogram = LatencyHistogram()
        active = chain.active
        if active is None:
            raise ModelFailed(
                f"model {version or '(unversioned)'} failed to start: {chain.failure}",
                tuple(chain.fallbacks),
                tuple(chain.probe_results),
            )
        self.signature: Signature = active.signature

    @classmethod
    def from_bytes(
        cls,
        data: bytes,
        *,
        golden: Golden | bytes | None = None,
        config: BackendConfig | str | None = None,
        candidates: Sequence[BackendConfig] | None = None,
        isolation: Isolation | str = Isolation.IN_PROCESS,
        version: str = "",
        probe_runs: int = DEFAULT_PROBE_RUNS,
        deadline_s: float = DEFAULT_DEADLINE_S,
        crash_limit: int = DEFAULT_CRASH_LIMIT,
        check_finite: bool = True,
        _fault: Fault | None = None,
    ) -> Model:
        """Load a decrypted ``.mnn`` model from memory and get it ready to serve.

        Config choice: with `config` (a `BackendConfig` or its key), that config is used,
        with the CPU default behind it as fallback; otherwise every one of `candidates`
        (default: `candidate_configs()` for this device) is probed and the fastest one
        whose outputs match `golden` (a `Golden` or its ``.npz`` bytes) serves, the
        others accepted by the probe forming the fallback chain.

        `isolation` says where MNN runs (`Isolation.WORKER` contains native crashes);
        `version` names the model in events, telemetry and `ModelSlot`; `probe_runs`
        timed runs are made per candidate; `deadline_s` bounds each request in a worker;
        `crash_limit` worker crashes in a row (no request served between them) make a
        config bad; `check_finite=False` lets
        non-finite outputs through instead of treating them as a config failure.
        Non-finite float inputs are refused as InvalidInput unless `check_finite=False`.
        `_fault` is a test-only hook (see `runtime.worker.Fault`).

        Raises ModelFailed (with probe results and fallbacks) if no config can serve.
        """
        isolation = Isolation(isolation)
        if isinstance(golden, bytes | bytearray | memoryview):
            golden = Golden.from_npz(bytes(golden))
        if isinstance(config, str):
            config = BackendConfig.from_key(config)
        label = re.sub(r"[^A-Za-z0-9._-]", "_", version)[:64]
        fd = sealed_memfd(data, name=f"skiff-model-{label}" if label else "skiff-model")
        chain = None
        try:
            make = _factory(fd, isolation, deadline_s, _fault)
            chain = ConfigChain(make, golden, crash_limit=crash_limit)
            if config is not None:
                chain.start_forced([config, DEFAULT_CONFIG])
            else:
                chain.start_probed(candidates or candidate_configs(), runs=probe_runs)
            return cls(fd, chain, version=version, isolation=isolation, check_finite=check_finite)
        except BaseException:
            if chain is not None:
                chain.close()  # e.g. interrupted mid-probe: no worker may outlive this
            os.close(fd)
            raise

    @property
    def config(self) -> BackendConfig | None:
        """Return the config serving now (None once the model failed)."""
        active = self._chain.wait_active()
        return active.config if active else None

    @property
    def actual_backend(self) -> Backend | None:
        """Return the backend the serving config really runs on (as MNN reports it)."""
        active = self._chain.wait_active()
        return active.actual_backend if active else None

    @property
    def failed(self) -> bool:
        """Tell whether no config is left (go back to the previous version)."""
        return self._chain.failed

    @property
    def probe_results(self) -> tuple[ProbeResult, ...]:
        """Return every probe run for this model, in order."""
        return tuple(self._chain.probe_results)

    @property
    def fallbacks(self) -> tuple[FallbackEvent, ...]:
        """Return every fallback so far, each with its reason."""
        return tuple(self._chain.fallbacks)

    @property
    def crashes(self) -> tuple[CrashEvent, ...]:
        """Return every worker crash so far."""
        return tuple(self._chain.crashes)

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run named inputs; return named outputs (fresh arrays the caller owns).

        Raises InvalidInput for inputs that do not fit the model (including non-finite
        floats, and inputs that make a sound config's outputs non-finite), WorkerCrashed
        if the worker died on this request (it is restarted in the background; the
        request is not retried), and ModelFailed when no config is left. A config that
        fails is replaced and the request retried once on the next one; a second
        failure of the same request reaches the caller as it is.
        """
        start = _now()
        arrays, exact = self.signature.check(inputs)
        if self._check_finite:
            _refuse_non_finite(self.signature, arrays)
        chain, failed_on = self._chain, None
        executor = chain.wait_active()  # not .active: None there may be a fallback loading
        while True:
            if executor is None:
                name = self.version or "(unversioned)"
                raise ModelFailed(f"model {name} failed: {chain.failure}", self.fallbacks)
            try:
                outputs, problem = self._attempt(executor, arrays, exact, failed_on)
            except ExecutorClosed:  # another request's fallback closed it: use the new one
                executor = chain.wait_active()
                continue
            if not problem:
                chain.record_success(executor.config)
                self.histogram.record_ns(_now() - start)
                return outputs
            if failed_on is not None:  # the replacement fails it too: not the configs' fault
                raise InferenceError(f"{problem} (this request failed on {failed_on.key} too)")
            failed_on = executor.config
            chain.fall_back(executor, problem)
            executor = chain.wait_active()

    def _attempt(
        self,
        executor: Executor,
        arrays: list[np.ndarray],
        exact: bool,
        failed_on: BackendConfig | None,
    ) -> tuple[dict[str, np.ndarray], str]:
        """Run once; return the outputs and "", or {} and how the config failed.

        Raises what is not the config's fault: InvalidInput, WorkerCrashed (the crash
        is counted instead), and non-finite outputs the inputs are to blame for.
        """
        try:
            outputs = executor.run(arrays, exact)
        except WorkerCrashed as exc:
            raise self._crashed(executor, exc) from None
        except ExecutorClosed:
            raise
        except ModelLoadError as exc:  # restarting a crashed worker failed
            return {}, f"load failed: {exc}"
        except InferenceError as exc:
            return {}, f"inference error: {exc}"
        bad = _non_finite(outputs) if self._check_finite else ""
        if bad and (failed_on is not None or self._chain.vouches_for(executor)):
            raise InvalidInput(_blame_inputs(bad, failed_on, executor.config))
        return (outputs, "") if not bad else ({}, f"non-finite outputs: {bad}")

    def _crashed(self, executor: Executor, exc: WorkerCrashed) -> WorkerCrashed:
        """Count a crash and restart the worker off this request's path; return the error."""
        event = self._chain.record_crash(executor, exc.event)
        if self._chain.wait_active() is executor:  # not retired by this crash
            # Loading may take long (GPU tuning); this request's caller should not wait.
            name = "skiff-worker-restart"
            threading.Thread(target=executor.restart, name=name, daemon=True).start()
        return WorkerCrashed(event)

    def telemetry(self) -> dict[str, Any]:
        """Return everything worth reporting about this model, as JSON-able data."""
        active = self._chain.wait_active()
        return {
            "version": self.version,
            "isolation": self.isolation.value,
            "config": active.config.key if active else None,
            "actual_backend": active.actual_backend.name if active else None,
            "failed": self._chain.failed,
            "failure": self._chain.failure,
            "latency": self.histogram.to_dict(),
            "probe_results": [r.to_dict() for r in self.probe_results],
            "fallbacks": [e.to_dict() for e in self.fallbacks],
            "crashes": [e.to_dict() for e in self.crashes],
        }

    def close(self) -> None:
        """Release the model, its worker and the plaintext memfd. Idempotent."""
        self._chain.close()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        config = self.config.key if self.config else "failed"
        return f"Model(version={self.version!r}, config={config}, {self.isolation.value})"


def _factory(fd: int, isolation: Isolation, deadline_s: float, fault: Fault | None) -> Any:
    """Return the function that loads the model with one config, as `isolation` says."""
    if isolation is Isolation.WORKER:
        from runtime.worker import WorkerExecutor

        def make_worker(config: BackendConfig) -> Executor:
            return WorkerExecutor(fd, config, deadline_s=deadline_s, fault=fault)

        return make_worker
    if fault is not None:
        raise ValueError("fault injection needs Isolation.WORKER")
    from runtime.engine import InProcessExecutor  # late: a worker-only parent never loads MNN

    def make_local(config: BackendConfig) -> Executor:
        return InProcessExecutor(fd_path(fd), config)

    return make_local


def _all_finite(arrays: Sequence[np.ndarray]) -> bool:
    """Tell whether every float array is finite, cheaply in the common case.

    A dot product of an array with itself is finite exactly when no element is inf or
    NaN, unless it overflows; only then (or on a non-finite result) is every element
    checked. It is a few times cheaper than np.isfinite(...).all() on small arrays.
    """
    for array in arrays:
        if array.dtype.kind != "f" or not array.size:
            continue
        flat = array.reshape(-1)
        if not math.isfinite(flat.dot(flat)) and not np.isfinite(flat).all():
            return False
    return True


def _non_finite(outputs: Mapping[str, np.ndarray]) -> str:
    """Name the outputs holding NaN or inf ("" when all are finite)."""
    if _all_finite(list(outputs.values())):
        return ""
    return ", ".join(name for name, a in outputs.items() if not _all_finite([a]))


def _refuse_non_finite(signature: Signature, arrays: Sequence[np.ndarray]) -> None:
    """Raise InvalidInput naming the first input (in model order) holding NaN or inf."""
    if not _all_finite(arrays):
        specs = signature.inputs
        name = next(s.name for s, a in zip(specs, arrays, strict=True) if not _all_finite([a]))
        raise InvalidInput(f"input {name!r} holds NaN or infinity")


def _blame_inputs(bad: str, first: BackendConfig | None, second: BackendConfig) -> str:
    """Explain why non-finite outputs are the inputs' fault, not the config's."""
    if first is None:
        why = f"{second.key} still matches the golden data"
    else:
        why = f"{first.key} and {second.key} both give them"
    return f"these inputs make outputs {bad} non-finite ({why}): outside the model's domain"
