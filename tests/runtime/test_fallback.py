"""The fallback chain: bad configs are dropped with a reason until none is left."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

from runtime.engine import InProcessExecutor
from runtime.errors import (
    DeadlineExceeded,
    InferenceError,
    InvalidInput,
    ModelFailed,
    ModelLoadError,
)
from runtime.fallback import ConfigChain
from runtime.golden import Golden
from runtime.mnn_host import fd_path, sealed_memfd
from runtime.model import Isolation, Model
from runtime.signature import Signature, TensorSpec
from tests.runtime._model_helpers import (
    CPU_1,
    CPU_1_HIGH,
    CPU_1_LOW,
    OPENCL,
    log_mnn,
    tiny_mnn,
    x16,
)

POSITIVE = {"x": np.abs(np.random.default_rng(0).standard_normal((2, 8))).astype(np.float32)}
NEGATIVE = {"x": -POSITIVE["x"]}  # log of a negative number: NaN on every config


@pytest.fixture(scope="module")
def log_golden() -> Golden:
    return Golden.make(log_mnn(), POSITIVE, isolated=False)


def test_an_odd_input_does_not_fail_a_config_that_still_matches_the_golden_data(log_golden):
    # log of a negative number is NaN on every config: the input is at fault, not the
    # config, and one such request must not roll the fleet back.
    model = Model.from_bytes(log_mnn(), golden=log_golden, candidates=[CPU_1, CPU_1_HIGH])
    try:
        first = model.config
        with pytest.raises(InvalidInput, match="y non-finite .* still matches the golden data"):
            model.run(NEGATIVE)
        assert model.fallbacks == () and model.config == first and not model.failed
        assert np.isfinite(model.run(POSITIVE)["y"]).all()
        report = json.loads(json.dumps(model.telemetry()))
        assert not report["failed"] and report["fallbacks"] == []
    finally:
        model.close()


def test_without_golden_data_an_odd_input_costs_at_most_one_fallback():
    with _model_with_chain([CPU_1, CPU_1_LOW, CPU_1_HIGH], data=log_mnn()) as model:
        with pytest.raises(InvalidInput, match="CPU/normal/t1.* and CPU/low/t1.* both give"):
            model.run(NEGATIVE)
        (event,) = model.fallbacks
        assert (event.from_config, event.to_config) == (CPU_1, CPU_1_LOW)
        assert event.reason == "non-finite outputs: y"
        assert model.config == CPU_1_LOW and not model.failed
        assert np.isfinite(model.run(POSITIVE)["y"]).all()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_are_refused_before_they_run(log_golden, bad):
    x = POSITIVE["x"].copy()
    x[1, 3] = bad
    with Model.from_bytes(log_mnn(), golden=log_golden, candidates=[CPU_1]) as model:
        with pytest.raises(InvalidInput, match="input 'x' holds NaN or infinity"):
            model.run({"x": x})
        assert model.fallbacks == () and not model.failed


def test_a_config_that_turns_bad_is_still_replaced(log_golden):
    faults = {}
    configs = [CPU_1, CPU_1_HIGH]
    with _model_with_chain(configs, data=log_mnn(), golden=log_golden, faults=faults) as model:
        faults[CPU_1] = "nan"  # e.g. a GPU driver gone wrong: NaN even on golden inputs
        assert np.isfinite(model.run(POSITIVE)["y"]).all()
        (event,) = model.fallbacks
        assert (event.from_config, event.to_config, event.reason) == (
            CPU_1,
            CPU_1_HIGH,
            "non-finite outputs: y",
        )


def test_a_request_that_fails_twice_reaches_the_caller_after_one_fallback():
    faults = {CPU_1: "raise", CPU_1_LOW: "raise"}
    with _model_with_chain([CPU_1, CPU_1_LOW, CPU_1_HIGH], faults=faults) as model:
        with pytest.raises(InferenceError, match="failed on CPU/normal/t1/mem-normal too"):
            model.run(x16())
        assert len(model.fallbacks) == 1 and model.config == CPU_1_LOW
        model.run(x16())  # CPU_1_LOW really is broken: this request moves on from it
        assert model.config == CPU_1_HIGH and len(model.fallbacks) == 2


class _WatchedCondition(threading.Condition):
    """The chain's condition, telling when some request has to wait on it."""

    def __init__(self, lock) -> None:
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


def _watch_waits(model):
    """Return an event set once a request waits on the chain (for a load to finish)."""
    watched = model._chain._changed = _WatchedCondition(model._chain._lock)
    return watched.waiting


def test_a_request_during_a_slow_fallback_waits_for_it_instead_of_failing():
    loading, waiting = threading.Event(), []

    def slow_load(config):
        if config == CPU_1_LOW and waiting:  # the fallback's load: ends once a request waits
            loading.set()
            waiting[0].wait(timeout=60)

    faults = {CPU_1: "raise"}
    model = _model_with_chain([CPU_1, CPU_1_LOW], faults=faults, on_load=slow_load)
    waiting.append(_watch_waits(model))
    answers = []
    first = threading.Thread(target=lambda: answers.append(model.run(x16())))
    first.start()
    try:
        assert loading.wait(timeout=60)
        assert not model.failed  # mid-fallback: nothing is active, yet nothing failed
        # Status reads answer at once mid-load: a health endpoint must not hang on it.
        assert model.state == "loading" and model.config is None
        assert model.telemetry()["state"] == "loading" and "config=loading" in repr(model)
        assert model.run(x16())["y"].shape == (1, 4)  # waits for CPU_1_LOW, then runs
    finally:
        waiting[0].set()  # never leave the first request hanging
        first.join()
        model.close()
    assert len(answers) == 1 and model.fallbacks[0].to_config == CPU_1_LOW
    assert model.state == "failed"  # closed


def test_a_request_waits_for_a_fallback_only_until_its_deadline():
    release, loading = threading.Event(), threading.Event()

    def slow_load(config):
        if config == CPU_1_LOW and not loading.is_set():
            loading.set()
            release.wait(timeout=60)

    model = _model_with_chain([CPU_1, CPU_1_LOW], faults={CPU_1: "raise"}, on_load=slow_load)
    model._deadline_s = 0.2
    first = threading.Thread(target=model.run, args=(x16(),))
    first.start()
    try:
        assert loading.wait(timeout=60)
        with pytest.raises(DeadlineExceeded, match="loading its next backend config"):
            model.run(x16())
        assert model.fallbacks[0].to_config == CPU_1_LOW  # the wait counted against nothing
        assert len(model.fallbacks) == 1
    finally:
        release.set()
        first.join()
    assert model.run(x16())["y"].shape == (1, 4) and model.config == CPU_1_LOW
    model.close()


def test_probing_closes_the_kept_executor_when_interrupted():
    made = []

    def make(config):
        if config == CPU_1_HIGH:
            raise KeyboardInterrupt
        made.append(_Recorder(config))
        return made[-1]

    chain = ConfigChain(make, None, crash_limit=3)
    with pytest.raises(KeyboardInterrupt):
        chain.start_probed([CPU_1, CPU_1_HIGH], runs=1)
    assert [e.closed for e in made] == [True]


class _Recorder:
    """An executor that answers zeros and remembers being closed."""

    def __init__(self, config):
        self.config, self.actual_backend, self.evidence, self.load_ms = config, None, "", 0.0
        self.signature = Signature((TensorSpec("x", (1, 16), "float32"),), ("y",))
        self.closed = False

    def run(self, arrays, exact):
        return {"y": np.zeros((1, 4), np.float32)}

    def restart(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


def test_golden_data_must_be_finite():
    with pytest.raises(ValueError, match="golden output 'y' is not finite"):
        Golden.make(log_mnn(), NEGATIVE, isolated=False)


def test_finite_check_can_be_turned_off(log_golden):
    with Model.from_bytes(log_mnn(), config=CPU_1, check_finite=False) as model:
        assert np.isnan(model.run(NEGATIVE)["y"]).all()
        assert not model.failed and model.fallbacks == ()


class _Faulty:
    """The real executor, except where `faults` says its config fails (an edge fault).

    `faults` maps a config to "raise" (every inference fails) or "nan" (every output is
    NaN); the test may change it after the model started.
    """

    def __init__(self, inner: InProcessExecutor, faults: dict) -> None:
        self._inner, self._faults = inner, faults
        self.config, self.signature = inner.config, inner.signature
        self.actual_backend, self.evidence, self.load_ms = inner.actual_backend, "", 0.0

    def run(self, arrays, exact):
        fault = self._faults.get(self.config)
        if fault == "raise":
            raise InferenceError(f"injected failure on {self.config.key}")
        outputs = self._inner.run(arrays, exact)
        return {k: np.full_like(v, np.nan) for k, v in outputs.items()} if fault else outputs

    def restart(self) -> None:
        pass

    def close(self) -> None:
        self._inner.close()


def _model_with_chain(configs, *, data=None, golden=None, faults=None, unloadable=(), on_load=None):
    fd = sealed_memfd(data or tiny_mnn())
    faults = {} if faults is None else faults

    def make(config):
        if on_load is not None:
            on_load(config)
        if config in unloadable:
            raise ModelLoadError(f"injected load failure on {config.key}")
        return _Faulty(InProcessExecutor(fd_path(fd), config), faults)

    chain = ConfigChain(make, golden, crash_limit=3)
    chain.start_forced(configs)
    return Model(fd, chain, version="v", isolation=Isolation.IN_PROCESS, check_finite=True)


def test_a_config_that_raises_is_replaced_and_the_request_still_succeeds():
    with _model_with_chain([CPU_1, CPU_1_LOW], faults={CPU_1: "raise"}) as model:
        assert model.config == CPU_1
        out = model.run(x16())  # fails on CPU_1, retried on CPU_1_LOW
        assert out["y"].shape == (1, 4) and model.config == CPU_1_LOW
        (event,) = model.fallbacks
        assert (event.from_config, event.to_config) == (CPU_1, CPU_1_LOW)
        assert "inference error: injected failure on CPU/normal/t1" in event.reason
        model.run(x16())
        assert len(model.fallbacks) == 1  # a bad config is never retried


def test_every_step_is_recorded_including_load_failures():
    configs = [CPU_1, CPU_1_LOW, CPU_1_HIGH]
    with _model_with_chain(configs, faults={CPU_1: "raise"}, unloadable=(CPU_1_LOW,)) as model:
        model.run(x16())
        assert model.config == CPU_1_HIGH
        steps = [(e.from_config, e.to_config) for e in model.fallbacks]
        assert steps == [(CPU_1, CPU_1_LOW), (CPU_1_LOW, CPU_1_HIGH)]
        assert "injected load failure" in model.fallbacks[1].reason
        assert all(e.time > 0 for e in model.fallbacks)


def test_a_model_with_no_usable_config_fails_at_start():
    with pytest.raises(ModelFailed) as info:
        Model.from_bytes(tiny_mnn(), candidates=[OPENCL])
    (result,) = info.value.probe_results
    assert not result.accepted and "not available" in result.error


def test_model_memfd_is_closed_when_start_fails():
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(ModelFailed):
        Model.from_bytes(tiny_mnn(), candidates=[OPENCL])
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_backend_found_missing_is_not_loaded_again_in_this_process(monkeypatch):
    from runtime import fallback
    from runtime.backends import Backend, BackendConfig, Precision
    from runtime.errors import BackendUnavailable

    monkeypatch.setattr(fallback, "_UNAVAILABLE", {})
    loads = []

    def make(config: BackendConfig):
        loads.append(config.key)
        raise BackendUnavailable(f"{config.backend.name} missing", Backend.CPU)

    configs = [
        BackendConfig(Backend.OPENCL, Precision.NORMAL),
        BackendConfig(Backend.OPENCL, Precision.LOW),
    ]
    for _ in range(2):  # two models, one after the other
        chain = ConfigChain(make, None, crash_limit=1)
        chain.start_probed(configs, runs=1)
        assert chain.failed
    # One load found OPENCL missing; every later OPENCL config was refused without one.
    assert loads == [configs[0].key]
    later = chain.probe_results[0]
    assert not later.accepted and "found by an earlier probe" in later.error
    assert later.actual_backend is Backend.CPU
