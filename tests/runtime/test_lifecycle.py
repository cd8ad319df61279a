"""Worker lifecycle for a daemon: idle deaths, slow restarts and loads, bounded waits.

Slow loads are real: the freshly spawned worker is SIGSTOPped, so its load stalls for
as long as the test wants, and SIGCONT lets it finish.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from runtime import _processes
from runtime.errors import DeadlineExceeded, WorkerCrashed
from runtime.model import Isolation, Model
from runtime.worker import Fault
from tests.runtime._model_helpers import CPU_1, CPU_1_LOW, tiny_mnn, x16

BOUND_S = 30  # a status read that takes this long is hanging, not slow


def _kill_and_wait(pid: int) -> None:
    """SIGKILL a worker as the OOM killer would, and wait until it could be reaped.

    Its main thread turns zombie before its other threads are gone; only then is the
    process reapable (waitid with WNOWAIT asks without reaping it).
    """
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + BOUND_S
    flags = os.WEXITED | os.WNOHANG | os.WNOWAIT
    while os.waitid(os.P_PID, pid, flags) is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert os.waitid(os.P_PID, pid, flags) is not None


def test_a_worker_that_died_idle_is_replaced_without_counting_a_crash():
    # crash_limit=1: had the idle death been counted, the only config would be retired.
    with Model.from_bytes(tiny_mnn(), config=CPU_1, isolation="worker", crash_limit=1) as model:
        expected = model.run(x16())["y"]
        pid = model._chain.active.pid
        _kill_and_wait(pid)
        assert (model.run(x16())["y"] == expected).all()  # no WorkerCrashed: it never ran
        assert model._chain.active.pid not in (None, pid)
        assert model.crashes == () and model.fallbacks == () and not model.failed
        (death,) = model.idle_deaths
        assert (death.signal, death.idle, death.count) == ("SIGKILL", True, 0)
        assert "while idle" in death.describe()
        report = json.loads(json.dumps(model.telemetry()))
        assert report["crashes"] == [] and report["idle_deaths"][0]["idle"] is True


@pytest.fixture
def stopped_spawns(monkeypatch):
    """SIGSTOP the workers spawned after the first `skip` ones; yield their processes."""
    state = {"skip": 1, "count": 0, "stopped": [], "event": threading.Event()}
    # A worker an earlier test left prewarmed in this process would be taken for the
    # restart without a spawn, unstopped (seen: DID NOT RAISE DeadlineExceeded).
    _processes.discard_warm()
    real = _processes.spawn

    def spawn(argv, options):
        proc = real(argv, options)
        state["count"] += 1
        if state["count"] > state["skip"]:
            os.kill(proc.pid, signal.SIGSTOP)
            state["stopped"].append(proc)
            state["event"].set()
        return proc

    monkeypatch.setattr(_processes, "spawn", spawn)
    yield state
    for proc in state["stopped"]:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)


def _in_thread(fn):
    """Call `fn` in a thread; return (thread, box) where box gets its result or error."""
    box: dict = {}

    def call():
        try:
            box["result"] = fn()
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            box["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    return thread, box


def _bounded(fn):
    """Call `fn` in another thread; fail if it hangs instead of returning."""
    thread, box = _in_thread(fn)
    thread.join(timeout=BOUND_S)
    assert not thread.is_alive(), f"{fn} hung"
    if "error" in box:
        raise box["error"]
    return box["result"]


def test_status_reads_answer_while_a_fallback_loads(stopped_spawns):
    # CPU_1_LOW crashes on its first request and is retired (crash_limit=1); the
    # fallback's worker (CPU_1) is stopped, so its load hangs until SIGCONT.
    fault = Fault("segv", on_request=1, config=CPU_1_LOW)
    model = Model.from_bytes(
        tiny_mnn(),
        config=CPU_1_LOW,
        isolation=Isolation.WORKER,
        crash_limit=1,
        deadline_s=0.5,
        _fault=fault,
    )
    try:
        crashing, box = _in_thread(lambda: model.run(x16()))
        assert stopped_spawns["event"].wait(timeout=BOUND_S)  # the fallback's load began
        report = _bounded(model.telemetry)
        assert report["state"] == "loading" and report["config"] is None
        assert report["crashes"][0]["signal"] == "SIGSEGV" and not report["failed"]
        assert "config=loading" in _bounded(lambda: repr(model))
        assert _bounded(lambda: (model.config, model.actual_backend, model.state)) == (
            None,
            None,
            "loading",
        )
        with pytest.raises(DeadlineExceeded, match="loading its next backend config"):
            _bounded(lambda: model.run(x16()))  # waited its deadline, not the load's
        (proc,) = stopped_spawns["stopped"]
        os.kill(proc.pid, signal.SIGCONT)
        crashing.join(timeout=BOUND_S)
        assert isinstance(box["error"], WorkerCrashed)
        # The resumed worker still has its start and its load ahead: a run sent before it
        # serves would spend its 0.5 s deadline on them (seen on a loaded run).
        deadline = time.monotonic() + BOUND_S
        while _bounded(model.telemetry)["state"] != "serving":
            assert time.monotonic() < deadline, "the fallback never loaded"
            time.sleep(0.01)
        assert model.run(x16())["y"].shape == (1, 4) and model.config == CPU_1
        assert len(model.crashes) == 1  # the request that timed out counted for nothing
    finally:
        model.close()


def test_a_request_waits_for_a_restart_only_until_its_deadline(stopped_spawns):
    with Model.from_bytes(tiny_mnn(), config=CPU_1, isolation="worker", deadline_s=0.5) as m:
        m.run(x16())
        _kill_and_wait(m._chain.active.pid)  # dies idle: the next request restarts it
        with pytest.raises(DeadlineExceeded, match="within 0.5 s: it was restarting"):
            _bounded(lambda: m.run(x16()))
        assert _bounded(m.telemetry)["state"] == "serving"  # a restart is not a fallback
        assert stopped_spawns["event"].wait(timeout=BOUND_S)
        (proc,) = stopped_spawns["stopped"]
        os.kill(proc.pid, signal.SIGCONT)
        _bounded(m._chain.active.restart)  # joins the restart under way
        assert m.run(x16())["y"].shape == (1, 4)
        assert m._chain.active.pid == proc.pid
        assert m.crashes == () and len(m.idle_deaths) == 1 and m.fallbacks == ()


def test_in_process_requests_wait_at_most_their_deadline():
    with Model.from_bytes(tiny_mnn(), config=CPU_1, deadline_s=0.2) as model:
        engine_lock = model._chain.active._lock
        with engine_lock:  # as if a request were stuck in MNN
            with pytest.raises(DeadlineExceeded, match="held CPU/normal/t1.* for more than 0.2"):
                _bounded(lambda: model.run(x16()))
            assert _bounded(model.telemetry)["state"] == "serving"
        assert model.run(x16())["y"].shape == (1, 4)
        assert model.fallbacks == () and not model.failed
