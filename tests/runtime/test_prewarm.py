"""A worker started before its model: the next executor takes it, the model comes later."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import runtime._processes as _processes
from runtime.engine import InProcessExecutor
from runtime.mnn_host import fd_path, sealed_memfd
from runtime.worker import Fault, WorkerExecutor, prewarm_worker
from tests.runtime._model_helpers import CPU_1, tiny_mnn, x16

MODULE = "runtime._worker_main"


@pytest.fixture
def model_fd():
    fd = sealed_memfd(tiny_mnn())
    yield fd
    os.close(fd)


@pytest.fixture(autouse=True)
def no_warm_left():
    yield
    _processes.discard_warm()


def _warm_pid() -> int:
    with _processes._warm_lock:
        return _processes._warm[MODULE][0].proc.pid


def _run(executor, fd) -> None:
    arrays, exact = executor.signature.check(x16())
    local = InProcessExecutor(fd_path(fd), CPU_1)
    try:
        expected = local.run(arrays, exact)["y"]
    finally:
        local.close()
    np.testing.assert_allclose(executor.run(arrays, exact)["y"], expected, rtol=1e-6)


def test_the_next_executor_takes_the_prewarmed_worker_and_its_model(model_fd):
    prewarm_worker()
    prewarm_worker()  # one waits at most: a second call starts nothing
    pid = _warm_pid()
    executor = WorkerExecutor(model_fd, CPU_1)
    try:
        assert executor.pid == pid and MODULE not in _processes._warm
        _run(executor, model_fd)
        # A replacement (the worker died) starts cold: nothing was prewarmed for it.
        os.kill(pid, 9)
        executor._proc.wait(timeout=30)  # dead between requests, not during one
        _run(executor, model_fd)
        assert executor.pid not in (None, pid)
    finally:
        executor.close()


def test_a_prewarmed_worker_that_died_is_not_taken(model_fd):
    prewarm_worker()
    with _processes._warm_lock:
        started = _processes._warm[MODULE][0]
    started.proc.kill()  # the OOM killer's pick, say
    started.proc.wait(timeout=30)
    executor = WorkerExecutor(model_fd, CPU_1)
    try:
        assert executor.pid != started.proc.pid
        _run(executor, model_fd)
    finally:
        executor.close()


def test_an_injected_fault_never_gets_a_prewarmed_worker(model_fd):
    prewarm_worker()
    pid = _warm_pid()
    executor = WorkerExecutor(model_fd, CPU_1, fault=Fault("exit", on_request=5))
    try:
        assert executor.pid != pid and _warm_pid() == pid  # still waiting for another
    finally:
        executor.close()


def test_a_prewarmed_worker_nobody_takes_ends(monkeypatch, model_fd):
    monkeypatch.setattr(_processes, "WARM_IDLE_S", 0.2)
    prewarm_worker()
    with _processes._warm_lock:
        started = _processes._warm[MODULE][0]
    deadline = time.monotonic() + 10
    while started.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert started.proc.returncode is not None and MODULE not in _processes._warm


def test_a_prewarmed_worker_whose_parent_lets_go_exits_cleanly():
    prewarm_worker()
    with _processes._warm_lock:
        started, _ = _processes._warm.pop(MODULE)
    started.sock.close()  # never handed a model
    assert started.proc.wait(timeout=30) == 0
    os.close(started.log_fd)
