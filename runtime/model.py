"""`Model`: one model version, loaded from bytes, run with named numpy inputs.

The public entry point for inference on the device::

    model = Model.from_bytes(decrypted, golden=golden, isolation=Isolation.WORKER)
    outputs = model.run({"x": x})          # {"y": array(...)}

`from_bytes` makes the process undumpable, puts the plaintext in a sealed memfd (never
on disk), picks a backend
config (probing the candidates against the golden data, or taking one forced from
outside, e.g. the fleet's recommendation) and loads the model with it, in this process
or in a crash-isolated worker. `run` validates the inputs, runs them, checks the
outputs are finite, records the latency, and moves along the fallback chain when the
config fails. Everything that happened (probe results, fallbacks, crashes, latency
histogram) is data in `telemetry()`.

Plaintext stays in memory in every mode. The caller's process holds the decrypted bytes
(and, in process, MNN's copy of the weights), so `from_bytes` calls
`runtime.hardening.forbid_core_dumps()` on it as the workers do on themselves: no core
file (RLIMIT_CORE 0 and PR_SET_DUMPABLE 0, so systemd-coredump or apport write nothing
either). The flag also stops processes of the same user from attaching (ptrace, gdb,
py-spy) or reading ``/proc/<pid>/mem``, and makes ``/proc/<pid>/`` files root-owned;
root (CAP_SYS_PTRACE) still can. It lasts for the process's life. A `Model` dropped
without `close()` releases its memfd and worker when it is garbage-collected.

One request never walks the whole chain: a bad config costs at most one fallback per
request, and non-finite outputs from a config that still matches the golden data (or
from the replacement as well) are blamed on the inputs. Otherwise one odd input could
mark every config bad and roll the fleet back.
"""

from __future__ import annotations

import asyncio
import enum
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from runtime._inputs import (
    blame_inputs,
    check_deadline,
    non_finite,
    refuse_non_finite,
    shape_hints,
)
from runtime.backends import DEFAULT_CONFIG, Backend, BackendConfig, candidate_configs
from runtime.errors import (
    DeadlineExceeded,
    ExecutorClosed,
    InferenceError,
    InvalidInput,
    ModelFailed,
    ModelLoadError,
    RuntimeFailure,
    WorkerCrashed,
)
from runtime.events import CrashEvent, FallbackEvent
from runtime.fallback import ConfigChain
from runtime.golden import Golden
from runtime.hardening import forbid_core_dumps
from runtime.histogram import LatencyHistogram
from runtime.mnn_host import fd_path, sealed_memfd
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
        self,
        fd: int,
        chain: ConfigChain,
        *,
        version: str,
        isolation: Isolation,
        check_finite: bool,
        deadline_s: float = DEFAULT_DEADLINE_S,
        idle_deaths: list[CrashEvent] | None = None,
    ) -> None:
        """Wrap a started chain; `from_bytes` is the way to build one."""
        self._fd, self._chain = fd, chain
        self.version, self.isolation = version, isolation
        self._check_finite, self._deadline_s = check_finite, deadline_s
        self._idle_deaths = idle_deaths if idle_deaths is not None else []
        self.histogram = LatencyHistogram()
        active = chain.active
        if active is None:
            raise ModelFailed(
                f"model {version or '(unversioned)'} failed to start: {chain.failure}",
                tuple(chain.fallbacks),
                tuple(chain.probe_results),
            )
        self.signature: Signature = active.signature
        # Dropped without close(): the memfd (plaintext) and any worker go with the object.
        self._release = weakref.finalize(self, _release, chain, fd)

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
        input_shapes: Mapping[str, Sequence[int]] | None = None,
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
        timed runs are made per candidate; `deadline_s` bounds each request's wait for
        its turn (behind other requests, a worker restart or a fallback's load:
        DeadlineExceeded) and, in a worker, its run (the worker is killed: WorkerCrashed).
        In process, MNN's own computation cannot be interrupted; only the waits are bounded;
        `crash_limit` worker crashes in a row (no request served between them) make a
        config bad; `check_finite=False` lets
        non-finite outputs through instead of treating them as a config failure.
        Non-finite float inputs are refused as InvalidInput unless `check_finite=False`.

        Without golden data the candidates are timed on zeros. `input_shapes` (e.g.
        ``{"x": (1, 3, 320, 320)}``) sizes inputs with dynamic dims for that; where an
        input still has a dynamic dim, or is an integer input (zero may be outside its
        domain), the candidates are loaded but not timed, the first one that loads
        serves, and `probe_untimed` (also in `telemetry()`) says why. Requests may use
        any shape the model accepts, whatever was probed.
        `_fault` is a test-only hook (see `runtime.worker.Fault`).

        Raises ModelFailed (with probe results and fallbacks) if no config can serve.
        """
        isolation = Isolation(isolation)
        check_deadline(deadline_s)
        shapes = shape_hints(input_shapes)
        if isinstance(golden, bytes | bytearray | memoryview):
            golden = Golden.from_npz(bytes(golden))
        if isinstance(config, str):
            config = BackendConfig.from_key(config)
        forbid_core_dumps()  # this process holds the plaintext: no core file may carry it
        label = re.sub(r"[^A-Za-z0-9._-]", "_", version)[:64]
        fd = sealed_memfd(data, name=f"skiff-model-{label}" if label else "skiff-model")
        chain, idle_deaths = None, []
        try:
            make = _factory(fd, isolation, deadline_s, _fault, idle_deaths.append)
            chain = ConfigChain(make, golden, crash_limit=crash_limit, input_shapes=shapes)
            if config is not None:
                chain.start_forced([config, DEFAULT_CONFIG])
            else:
                chain.start_probed(candidates or candidate_configs(), runs=probe_runs)
            options = {"deadline_s": deadline_s, "idle_deaths": idle_deaths}
            return cls(
                fd,
                chain,
                version=version,
                isolation=isolation,
                check_finite=check_finite,
                **options,
            )
        except BaseException:
            if chain is not None:
                chain.close()  # e.g. interrupted mid-probe: no worker may outlive this
            os.close(fd)
            raise

    # Status reads never wait: a health endpoint must answer while a fallback loads.

    @property
    def config(self) -> BackendConfig | None:
        """Return the config serving now (None while a fallback loads, see `state`, or failed)."""
        active = self._chain.active
        return active.config if active else None

    @property
    def actual_backend(self) -> Backend | None:
        """Return the backend the serving config really runs on (as MNN reports it)."""
        active = self._chain.active
        return active.actual_backend if active else None

    @property
    def state(self) -> str:
        """Return "serving", "loading" (a fallback is loading the next config) or "failed"."""
        return self._chain.state

    @property
    def failed(self) -> bool:
        """Tell whether no config is left (go back to the previous version)."""
        return self._chain.failed

    @property
    def probe_results(self) -> tuple[ProbeResult, ...]:
        """Return every probe run for this model, in order."""
        return tuple(self._chain.probe_results)

    @property
    def probe_untimed(self) -> str | None:
        """Return why the probe could not time the candidates (None if it did, or none ran)."""
        return next((r.untimed for r in self._chain.probe_results if r.untimed), None)

    @property
    def fallbacks(self) -> tuple[FallbackEvent, ...]:
        """Return every fallback so far, each with its reason."""
        return tuple(self._chain.fallbacks)

    @property
    def crashes(self) -> tuple[CrashEvent, ...]:
        """Return every worker crash so far."""
        return tuple(self._chain.crashes)

    @property
    def idle_deaths(self) -> tuple[CrashEvent, ...]:
        """Return the workers found dead between requests (restarted, never counted)."""
        return tuple(self._idle_deaths)

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
            refuse_non_finite(self.signature, arrays)
        chain, failed_on = self._chain, None
        deadline_s = self._deadline_s
        # .active is the fast path; None may be a fallback loading: then wait for it.
        executor = chain.active or chain.wait_active(deadline_s)
        while True:
            if executor is None:
                name = self.version or "(unversioned)"
                raise ModelFailed(f"model {name} failed: {chain.failure}", self.fallbacks)
            try:
                outputs, problem = self._attempt(executor, arrays, exact, failed_on)
            except ExecutorClosed:  # another request's fallback closed it: use the new one
                executor = chain.wait_active(deadline_s)
                continue
            if not problem:
                chain.record_success(executor.config)
                self.histogram.record_ns(_now() - start)
                return outputs
            if failed_on is not None:  # the replacement fails it too: not the configs' fault
                raise InferenceError(f"{problem} (this request failed on {failed_on.key} too)")
            failed_on = executor.config
            chain.fall_back(executor, problem)
            executor = chain.wait_active(deadline_s)

    async def run_async(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """`run` for a caller on an asyncio loop (an app-facing server): same answers, errors.

        The common case, a worker free now, waits for the worker on the loop, with no
        thread hop (`WorkerExecutor.run_async`); anything else runs `run` in a thread:
        in process, a worker busy or restarting, large inputs, and a config failing the
        request or giving non-finite outputs (then `run` tries it again and decides).
        """
        executor = self._chain.active
        direct = getattr(executor, "run_async", None)
        if direct is not None:
            start = _now()
            arrays, exact = self.signature.check(inputs)
            if self._check_finite:
                refuse_non_finite(self.signature, arrays)
            try:
                outputs = await direct(arrays, exact)
            except WorkerCrashed as exc:
                raise self._crashed(executor, exc) from None
            except InvalidInput:
                raise
            except RuntimeFailure:  # the config's failure: `run` falls back and retries
                outputs = None
            if outputs is not None and not (self._check_finite and non_finite(outputs)):
                self._chain.record_success(executor.config)
                self.histogram.record_ns(_now() - start)
                return outputs
        return await asyncio.get_running_loop().run_in_executor(None, self.run, inputs)

    def run_batch(
        self, batch: Sequence[Mapping[str, np.ndarray]]
    ) -> list[dict[str, np.ndarray] | RuntimeFailure]:
        """Run several named inputs, in one round trip to a worker; return each one's answer.

        Each item's answer, in order, is what `run` would give it: its outputs, or the
        RuntimeFailure `run` would raise (InvalidInput, WorkerCrashed, ModelFailed...).
        The items go to the serving config together (`WorkerExecutor.run_batch`; in
        process, one by one); an item whose config fails on it is run again alone through
        `run`, which falls back as usual. A worker crash fails the items it had not
        answered, and counts once. Each item's latency is recorded as its share of the
        batch's time.
        """
        answers: list = [None] * len(batch)
        pending = []
        for i, inputs in enumerate(batch):
            try:
                arrays, exact = self.signature.check(inputs)
                if self._check_finite:
                    refuse_non_finite(self.signature, arrays)
            except InvalidInput as exc:
                answers[i] = exc
            else:
                pending.append((i, arrays, exact))
        executor = self._chain.active
        together = getattr(executor, "run_batch", None)
        if together is not None and len(pending) > 1:
            self._run_together(executor, together, pending, answers)
        for i, answer in enumerate(answers):
            if answer is None:  # alone, through the fallback chain
                try:
                    answers[i] = self.run(batch[i])
                except RuntimeFailure as exc:
                    answers[i] = exc
        return answers

    def _run_together(self, executor: Executor, together, pending: list, answers: list) -> None:
        """Fill in the answers of `pending` (index, arrays, exact) from one batch run.

        Items the config failed on (and every item, if the batch could not be run) stay
        None, for `run` to take one by one.
        """
        start = _now()
        try:
            got = together([(arrays, exact) for _, arrays, exact in pending])
        except DeadlineExceeded as exc:  # no turn within the deadline: none would get one
            for i, _, _ in pending:
                answers[i] = exc
            return
        except RuntimeFailure:  # closed, restart failed, too large: each goes alone
            return
        share = (_now() - start) // len(pending)
        crash = None
        for (i, _, _), answer in zip(pending, got, strict=True):
            if isinstance(answer, dict):
                if not (self._check_finite and non_finite(answer)):
                    answers[i] = answer
                    self.histogram.record_ns(share)
            elif isinstance(answer, WorkerCrashed):
                crash = crash or self._crashed(executor, answer)
                answers[i] = crash
            elif isinstance(answer, InvalidInput):
                answers[i] = answer
        if any(isinstance(a, dict) for a in answers):
            self._chain.record_success(executor.config)

    def probe_others(
        self,
        candidates: Sequence[BackendConfig] | None = None,
        *,
        runs: int = DEFAULT_PROBE_RUNS,
        stop: threading.Event | None = None,
    ) -> tuple[ProbeResult, ...]:
        """Probe the other candidates while this model serves; switch if one is faster.

        For a model started on one `config` (say, the one its previous version won with),
        so that it served after a single load: this finishes the probe `from_bytes` would
        have made, off the request path (call it from a thread of its own). The serving
        config is timed again beside `candidates` (default: `candidate_configs()`), and
        one faster beyond timing noise takes over between requests; the accepted ones
        form the fallback chain. Returns this round's results, the serving config's first
        (none if the model is closed or failed). Closing the model, or setting `stop`,
        ends it after the probe in progress, switching nothing.
        """
        configs = candidates or candidate_configs()
        return tuple(self._chain.probe_rest(configs, runs=runs, stop=stop))

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
        bad = non_finite(outputs) if self._check_finite else ""
        if bad and (failed_on is not None or self._chain.vouches_for(executor)):
            raise InvalidInput(blame_inputs(bad, failed_on, executor.config))
        return (outputs, "") if not bad else ({}, f"non-finite outputs: {bad}")

    def _crashed(self, executor: Executor, exc: WorkerCrashed) -> WorkerCrashed:
        """Count a crash and restart the worker off this request's path; return the error."""
        event = self._chain.record_crash(executor, exc.event)
        if self._chain.active is executor:  # not retired by this crash
            # Loading may take long (GPU tuning); this request's caller should not wait.
            name = "skiff-worker-restart"
            threading.Thread(target=executor.restart, name=name, daemon=True).start()
        return WorkerCrashed(event)

    def telemetry(self) -> dict[str, Any]:
        """Return everything worth reporting about this model, as JSON-able data."""
        active = self._chain.active
        return {
            "version": self.version,
            "isolation": self.isolation.value,
            "state": self._chain.state,
            "config": active.config.key if active else None,
            "actual_backend": active.actual_backend.name if active else None,
            "failed": self._chain.failed,
            "failure": self._chain.failure,
            "latency": self.histogram.to_dict(),
            "probe_results": [r.to_dict() for r in self.probe_results],
            "probe_untimed": self.probe_untimed,
            "fallbacks": [e.to_dict() for e in self.fallbacks],
            "crashes": [e.to_dict() for e in self.crashes],
            "idle_deaths": [e.to_dict() for e in self.idle_deaths],
        }

    def close(self) -> None:
        """Release the model, its worker and the plaintext memfd. Idempotent."""
        self._release()  # runs once, whether called here or by the garbage collector
        self._fd = -1

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        active = self._chain.active
        config = active.config.key if active else self._chain.state
        return f"Model(version={self.version!r}, config={config}, {self.isolation.value})"


def _release(chain: ConfigChain, fd: int) -> None:
    """Close the chain (executors, workers), then the plaintext memfd once nothing loads it."""
    chain.close(then=lambda: os.close(fd))


def _factory(
    fd: int,
    isolation: Isolation,
    deadline_s: float,
    fault: Fault | None,
    on_idle_death: Callable[[CrashEvent], None],
) -> Any:
    """Return the function that loads the model with one config, as `isolation` says."""
    if isolation is Isolation.WORKER:
        from runtime.worker import WorkerExecutor

        def make_worker(config: BackendConfig) -> Executor:
            options = {"deadline_s": deadline_s, "fault": fault, "on_idle_death": on_idle_death}
            return WorkerExecutor(fd, config, **options)

        return make_worker
    if fault is not None:
        raise ValueError("fault injection needs Isolation.WORKER")
    from runtime.engine import InProcessExecutor  # late: a worker-only parent never loads MNN

    def make_local(config: BackendConfig) -> Executor:
        return InProcessExecutor(fd_path(fd), config, deadline_s=deadline_s)

    return make_local
