"""The fallback chain: bad configs are dropped with a reason until none is left."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from runtime._memfd import fd_path, sealed_memfd
from runtime.backends import BackendConfig
from runtime.engine import InProcessExecutor
from runtime.errors import InferenceError, ModelFailed, ModelLoadError
from runtime.fallback import ConfigChain
from runtime.golden import Golden
from runtime.model import Isolation, Model
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


def test_non_finite_outputs_walk_the_chain_to_the_end(log_golden):
    model = Model.from_bytes(log_mnn(), golden=log_golden, candidates=[CPU_1, CPU_1_LOW])
    try:
        first = model.config
        assert np.isfinite(model.run(POSITIVE)["y"]).all()
        with pytest.raises(ModelFailed, match="no backend config left") as info:
            model.run(NEGATIVE)
        assert model.failed and model.config is None
        assert [e.from_config for e in model.fallbacks][0] == first
        assert len(model.fallbacks) == 2 and model.fallbacks[-1].to_config is None
        assert all(e.reason == "non-finite outputs: y" for e in model.fallbacks)
        assert info.value.fallbacks == model.fallbacks
        with pytest.raises(ModelFailed):  # stays failed: the caller goes back a version
            model.run(POSITIVE)
        report = json.loads(json.dumps(model.telemetry()))
        assert report["failed"] and len(report["fallbacks"]) == 2
    finally:
        model.close()


def test_golden_data_must_be_finite():
    with pytest.raises(ValueError, match="golden output 'y' is not finite"):
        Golden.make(log_mnn(), NEGATIVE, isolated=False)


def test_finite_check_can_be_turned_off(log_golden):
    with Model.from_bytes(log_mnn(), config=CPU_1, check_finite=False) as model:
        assert np.isnan(model.run(NEGATIVE)["y"]).all()
        assert not model.failed and model.fallbacks == ()


class _FailsOn:
    """The real executor, except that one config fails every inference (an edge fault)."""

    def __init__(self, inner: InProcessExecutor, bad: BackendConfig) -> None:
        self._inner, self._bad = inner, bad
        self.config, self.signature = inner.config, inner.signature
        self.actual_backend, self.evidence, self.load_ms = inner.actual_backend, "", 0.0

    def run(self, arrays, exact):
        if self.config == self._bad:
            raise InferenceError(f"injected failure on {self.config.key}")
        return self._inner.run(arrays, exact)

    def restart(self) -> None:
        pass

    def close(self) -> None:
        self._inner.close()


def _model_with_chain(configs, *, fails_on=None, unloadable=()):
    fd = sealed_memfd(tiny_mnn())

    def make(config):
        if config in unloadable:
            raise ModelLoadError(f"injected load failure on {config.key}")
        return _FailsOn(InProcessExecutor(fd_path(fd), config), fails_on)

    chain = ConfigChain(make, None, crash_limit=3)
    chain.start_forced(configs)
    return Model(fd, chain, version="v", isolation=Isolation.IN_PROCESS, check_finite=True)


def test_a_config_that_raises_is_replaced_and_the_request_still_succeeds():
    with _model_with_chain([CPU_1, CPU_1_LOW], fails_on=CPU_1) as model:
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
    with _model_with_chain(configs, fails_on=CPU_1, unloadable=(CPU_1_LOW,)) as model:
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
