"""Probing the other configs while a model serves: a faster one takes over, nothing else."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from runtime.engine import InProcessExecutor
from runtime.fallback import ConfigChain
from runtime.golden import Golden
from runtime.mnn_host import fd_path, sealed_memfd
from runtime.model import Isolation, Model
from tests.runtime._model_helpers import CPU_1, CPU_1_HIGH, CPU_1_LOW, OPENCL, tiny_mnn, x16


@pytest.fixture(scope="module")
def golden() -> Golden:
    return Golden.make(tiny_mnn(), x16(), isolated=False)


class _Slowed:
    """The real executor, slowed down or made wrong per config (`behaviour`, live)."""

    def __init__(self, inner: InProcessExecutor, behaviour: dict, made: list) -> None:
        self._inner, self._behaviour = inner, behaviour
        self.config, self.signature = inner.config, inner.signature
        self.actual_backend, self.evidence, self.load_ms = inner.actual_backend, "", 0.0
        self.closed = False
        made.append(self)

    def run(self, arrays, exact):
        how = self._behaviour.get(self.config, 0.0)
        outputs = self._inner.run(arrays, exact)
        if how == "wrong":
            return {k: v + 1.0 for k, v in outputs.items()}
        time.sleep(how)
        return outputs

    def restart(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True
        self._inner.close()


def _serving(first, golden, behaviour, *, on_load=None):
    """A model started on `first` alone (as after a promote), and every executor made."""
    fd = sealed_memfd(tiny_mnn())
    made: list[_Slowed] = []

    def make(config):
        if on_load is not None:
            on_load(config)
        return _Slowed(InProcessExecutor(fd_path(fd), config), behaviour, made)

    chain = ConfigChain(make, golden, crash_limit=3)
    chain.start_forced([first])
    model = Model(fd, chain, version="m:2", isolation=Isolation.IN_PROCESS, check_finite=True)
    return model, made, fd


def test_a_faster_config_found_later_takes_over_and_the_others_back_it(golden):
    # Delays far above a loaded machine's timing noise (2 ms steps flipped under load).
    behaviour = {CPU_1: 0.04, CPU_1_HIGH: 0.02}  # CPU_1_LOW: no delay, the fastest
    model, made, _ = _serving(CPU_1, golden, behaviour)
    with model:
        assert model.config == CPU_1 and len(made) == 1  # served after one load
        results = model.probe_others([CPU_1, CPU_1_LOW, CPU_1_HIGH, OPENCL], runs=5)
        assert [r.config for r in results][:3] == [CPU_1, CPU_1_LOW, CPU_1_HIGH]
        assert results[0].accepted and results[0].p50_us >= 40_000  # timed again, as served
        assert model.config == CPU_1_LOW
        assert made[0].closed  # the old executor went once the switch was made
        assert [e.closed for e in made[1:]] == [False, True]  # the winner stays, not the rest
        assert np.allclose(model.run(x16())["y"], golden.outputs["y"], atol=1e-5)
        # The fallback chain is what the probe ranked, fastest first, the serving one left out.
        assert model._chain._pending == [CPU_1_HIGH, CPU_1]
        assert {r.config for r in model.probe_results} >= {CPU_1, CPU_1_LOW, CPU_1_HIGH}


def test_the_serving_config_stays_when_nothing_is_faster(golden):
    behaviour = {CPU_1_LOW: 0.03, CPU_1_HIGH: 0.03}
    model, made, _ = _serving(CPU_1, golden, behaviour)
    with model:
        model.probe_others([CPU_1_LOW, CPU_1_HIGH], runs=5)
        assert model.config == CPU_1 and not made[0].closed
        assert all(e.closed for e in made[1:])  # no executor outlives the round


def test_a_fast_config_whose_outputs_are_wrong_never_serves(golden):
    behaviour = {CPU_1: 0.004, CPU_1_LOW: "wrong"}
    model, made, _ = _serving(CPU_1, golden, behaviour)
    with model:
        results = model.probe_others([CPU_1_LOW], runs=5)
        assert not results[1].accepted and "rejected" in results[1].error
        assert model.config == CPU_1 and made[1].closed
        assert model._chain._pending == []  # nor is it a fallback


def test_a_config_marked_bad_is_not_probed_again(golden):
    behaviour = {CPU_1: "wrong"}
    fd = sealed_memfd(tiny_mnn())
    made: list[_Slowed] = []
    chain = ConfigChain(
        lambda c: _Slowed(InProcessExecutor(fd_path(fd), c), behaviour, made), None, crash_limit=3
    )
    chain.start_forced([CPU_1, CPU_1_HIGH])
    with Model(fd, chain, version="m", isolation=Isolation.IN_PROCESS, check_finite=True) as model:
        chain.fall_back(chain.active, "injected")
        assert model.config == CPU_1_HIGH
        loads = len(made)
        results = model.probe_others([CPU_1, CPU_1_HIGH], runs=2)
        assert [r.config for r in results] == [CPU_1_HIGH] and len(made) == loads


def test_requests_keep_being_answered_through_the_probe_and_the_switch(golden):
    behaviour = {CPU_1: 0.02}  # far above a loaded machine's timing noise
    model, _, _ = _serving(CPU_1, golden, behaviour)
    answered, errors, stop = [], [], threading.Event()

    def ask():
        while not stop.is_set():
            try:
                answered.append(model.run(x16())["y"])
            except Exception as exc:  # noqa: BLE001 - any error fails the test below
                errors.append(exc)

    asker = threading.Thread(target=ask)
    with model:
        asker.start()
        try:
            model.probe_others([CPU_1_LOW, CPU_1_HIGH], runs=20)
        finally:
            stop.set()
            asker.join()
        assert model.config != CPU_1
    assert errors == [] and len(answered) > 20
    assert all(np.allclose(y, golden.outputs["y"], atol=1e-5) for y in answered)


def test_closing_the_model_mid_probe_stops_it_and_keeps_the_memfd_until_then(golden):
    holder: dict = {}
    open_at_load = []

    def on_load(config):
        if config == CPU_1_LOW:
            holder["model"].close()  # e.g. the next version swapped in meanwhile
            open_at_load.append(_is_open(holder["fd"]))

    model, made, fd = _serving(CPU_1, golden, {}, on_load=on_load)
    holder.update(model=model, fd=fd)
    results = model.probe_others([CPU_1_LOW, CPU_1_HIGH], runs=2)
    assert open_at_load == [True]  # the load in progress still had the model's bytes
    assert [r.config for r in results] == [CPU_1, CPU_1_LOW]  # and nothing after it
    assert all(e.closed for e in made) and not _is_open(fd)
    assert model.probe_others() == ()  # a closed model probes nothing


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_stopped_round_ends_after_the_probe_in_progress_and_switches_nothing(golden):
    stop = threading.Event()
    model, made, _ = _serving(
        CPU_1, golden, {CPU_1: 0.004}, on_load=lambda c: c == CPU_1_LOW and stop.set()
    )
    with model:
        results = model.probe_others([CPU_1_LOW, CPU_1_HIGH], runs=5, stop=stop)
        assert [r.config for r in results] == [CPU_1, CPU_1_LOW]  # CPU_1_HIGH never loaded
        assert results[1].accepted and model.config == CPU_1  # faster, but the round stopped
        assert not made[0].closed and all(e.closed for e in made[1:])
