"""Crash isolation: a worker that dies or hangs takes only itself down, deterministically.

The faults are real (a NULL read for SIGSEGV, abort(), SIGKILL as the OOM killer sends,
a wait that never ends) and fire on a given request number, so no test races a crash:
a dead worker closes its socket, and the parent's blocked read returns at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from runtime import _mnn_diagnosis as diagnosis
from runtime import _wire, _worker_main, fallback
from runtime import worker as worker_module
from runtime._processes import child_env as _child_env
from runtime.errors import (
    BackendUnavailable,
    InvalidInput,
    ModelFailed,
    ModelLoadError,
    WorkerCrashed,
)
from runtime.mnn_host import sealed_memfd
from runtime.model import Isolation, Model
from runtime.worker import Fault, WorkerExecutor
from tests.runtime._model_helpers import (
    CPU_1,
    CPU_1_LOW,
    OPENCL,
    reference,
    tiny_mnn,
    tiny_onnx,
    x16,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_fd():
    fd = sealed_memfd(tiny_mnn())
    yield fd
    os.close(fd)


def test_worker_gives_the_same_answers_and_gets_the_model_from_a_memfd():
    with Model.from_bytes(tiny_mnn(), config=CPU_1, isolation=Isolation.WORKER) as model:
        inputs = x16(seed=5, batch=3)
        np.testing.assert_allclose(
            model.run(inputs)["y"], reference(tiny_onnx(), inputs)["y"], rtol=1e-4
        )
        worker = model._chain.active
        links = [
            os.readlink(f"/proc/{worker.pid}/fd/{n}") for n in os.listdir(f"/proc/{worker.pid}/fd")
        ]
        assert any(link.startswith("/memfd:skiff-model") for link in links)
        assert not any(link.endswith(".mnn") for link in links)
        with pytest.raises(InvalidInput, match="cannot run these shapes"):
            model.run({"x": np.zeros((1, 17), np.float32)})
        assert model.telemetry()["isolation"] == "worker" and model.crashes == ()


def test_with_workers_mnn_never_enters_the_parent(tmp_path):
    model = tmp_path / "model.bin"
    model.write_bytes(tiny_mnn())
    script = textwrap.dedent(
        f"""
        import sys, numpy as np
        from runtime.golden import Golden
        from runtime.model import Model
        data = open({str(model)!r}, "rb").read()
        golden = Golden.make(data, {{"x": np.ones((1, 16), np.float32)}})
        with Model.from_bytes(data, golden=golden, isolation="worker", probe_runs=2) as m:
            m.run(dict(golden.inputs))
        print(sorted(n for n in sys.modules if n.split(".")[0] in ("MNN", "_mnncengine")))
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[]\n"


@pytest.mark.parametrize(
    ("kind", "reason", "sig", "code"),
    [
        ("segv", "signal", "SIGSEGV", None),
        ("abort", "signal", "SIGABRT", None),
        ("kill", "signal", "SIGKILL", None),  # what the OOM killer does
        ("exit", "exit", None, 3),
    ],
)
def test_a_dying_worker_is_reported_and_replaced(model_fd, kind, reason, sig, code):
    worker = WorkerExecutor(model_fd, CPU_1, fault=Fault(kind, on_request=2))
    try:
        arrays = [x16()["x"]]
        expected = worker.run(arrays, True)["y"]
        first_pid = worker.pid
        with pytest.raises(WorkerCrashed) as info:
            worker.run(arrays, True)
        event = info.value.event
        assert (event.reason, event.signal, event.exit_code) == (reason, sig, code)
        assert event.config == CPU_1 and f"injected fault {kind}" in event.detail
        assert worker.pid is None  # reaped; nothing restarted behind the caller's back
        np.testing.assert_array_equal(worker.run(arrays, True)["y"], expected)
        assert worker.pid not in (None, first_pid) and worker.restarts == 1
    finally:
        worker.close()


def test_the_worker_log_stays_small_and_keeps_its_end(model_fd):
    worker = WorkerExecutor(model_fd, CPU_1, fault=Fault("segv", on_request=2))
    try:
        chatter = b"".join(b"MNN says %d\n" % i for i in range(20_000))  # ~250 KiB
        os.write(worker._log_fd, chatter)  # as a chatty worker's stdout would
        worker.run([x16()["x"]], True)
        size = os.fstat(worker._log_fd).st_size
        assert size <= worker_module._LOG_KEEP
        assert os.pread(worker._log_fd, size, 0).endswith(b"MNN says 19999\n")
        with pytest.raises(WorkerCrashed) as info:
            worker.run([x16()["x"]], True)
        assert info.value.event.detail == "skiff worker: injected fault segv"
    finally:
        worker.close()


def test_a_hung_worker_is_killed_at_its_deadline(model_fd):
    # The fault waits forever, so the deadline always fires: no timing luck involved.
    worker = WorkerExecutor(model_fd, CPU_1, deadline_s=0.5, fault=Fault("hang"))
    try:
        with pytest.raises(WorkerCrashed, match="missed its deadline") as info:
            worker.run([x16()["x"]], True)
        assert (info.value.event.reason, info.value.event.signal) == ("deadline", "SIGKILL")
    finally:
        worker.close()


def test_repeated_crashes_move_the_model_to_the_next_config():
    fault = Fault("segv", on_request=1, config=CPU_1_LOW)  # only the LOW config crashes
    model = Model.from_bytes(
        tiny_mnn(), config=CPU_1_LOW, isolation="worker", crash_limit=2, _fault=fault
    )
    try:
        pid = model._chain.active.pid
        with pytest.raises(WorkerCrashed, match="SIGSEGV") as first:
            model.run(x16())
        assert first.value.event.count == 1 and model.config == CPU_1_LOW
        model._chain.active.restart()  # joins the restart already under way
        assert model._chain.active.pid not in (None, pid) and model._chain.active.restarts == 1
        with pytest.raises(WorkerCrashed) as second:
            model.run(x16())
        assert second.value.event.count == 2
        assert model.config == CPU_1  # the crash limit retired CPU_1_LOW
        (event,) = model.fallbacks
        assert (event.from_config, event.to_config) == (CPU_1_LOW, CPU_1)
        assert event.reason == "crashed 2 times, last: SIGSEGV"
        assert model.run(x16())["y"].shape == (1, 4)
        report = json.loads(json.dumps(model.telemetry()))
        assert [c["signal"] for c in report["crashes"]] == ["SIGSEGV", "SIGSEGV"]
    finally:
        model.close()


def test_only_crashes_in_a_row_retire_a_config():
    fault = Fault("segv", on_request=2)  # every worker serves one request, then crashes
    with Model.from_bytes(
        tiny_mnn(), config=CPU_1_LOW, isolation="worker", crash_limit=2, _fault=fault
    ) as model:
        for _ in range(3):
            assert model.run(x16())["y"].shape == (1, 4)  # resets the count
            with pytest.raises(WorkerCrashed) as info:
                model.run(x16())
            assert info.value.event.count == 1
        assert model.config == CPU_1_LOW and model.fallbacks == ()
        assert [c.count for c in model.crashes] == [1, 1, 1]


def test_a_crashed_request_does_not_wait_for_the_restart(monkeypatch):
    release, waited = threading.Event(), []
    real_start = WorkerExecutor._start

    def slow_start(self):
        if self.restarts:  # restarts only: loading a big model may take minutes
            waited.append(release.wait(timeout=10))
        real_start(self)

    monkeypatch.setattr(WorkerExecutor, "_start", slow_start)
    fault = Fault("segv", on_request=1)
    with Model.from_bytes(tiny_mnn(), config=CPU_1, isolation="worker", _fault=fault) as model:
        with pytest.raises(WorkerCrashed):
            model.run(x16())
        release.set()  # only now may the restart finish
        model._chain.active.restart()  # joins it
        assert waited == [True] and model._chain.active.pid is not None


@pytest.fixture
def spawned(monkeypatch):
    """Every worker process an executor started (or took warm) in the test's own thread.

    Not every `subprocess.Popen` of the process: a worker that another test's executor
    restarts, or spawns warm, in a thread of its own may start meanwhile (it happened).
    """
    procs, owner = [], threading.get_ident()
    start = worker_module._processes.start

    def recorded(*args, **kwargs):
        started = start(*args, **kwargs)
        if threading.get_ident() == owner:
            procs.append(started.proc)
        return started

    monkeypatch.setattr(worker_module._processes, "start", recorded)
    return procs


def test_an_unexpected_failure_while_starting_leaves_no_worker(model_fd, spawned, monkeypatch):
    def broken(d):
        raise RuntimeError("unexpected")

    monkeypatch.setattr(worker_module.Signature, "from_dict", broken)
    with pytest.raises(RuntimeError, match="unexpected"):
        WorkerExecutor(model_fd, CPU_1)
    (proc,) = spawned
    assert proc.returncode is not None  # stopped and reaped, not left running


def test_an_unknown_fallback_backend_is_never_reported_as_the_cpu(model_fd, spawned, monkeypatch):
    reply = {"ok": False, "kind": "unavailable", "actual": "QUANTUM", "error": "no"}
    monkeypatch.setattr(WorkerExecutor, "_call", lambda self, *a, **k: (reply, {}))
    with pytest.raises(BackendUnavailable) as info:
        WorkerExecutor(model_fd, OPENCL)
    assert info.value.actual is None
    assert all(proc.returncode is not None for proc in spawned)


def test_a_failed_restart_is_reported_as_a_load_failure(monkeypatch):
    fault = Fault("segv", on_request=1, config=CPU_1_LOW)
    model = Model.from_bytes(
        tiny_mnn(), config=CPU_1_LOW, isolation="worker", crash_limit=5, _fault=fault
    )
    try:
        real_load = WorkerExecutor._load

        def load(self):
            if self.restarts and self.config == CPU_1_LOW:
                raise ModelLoadError("out of GPU memory")
            real_load(self)

        monkeypatch.setattr(WorkerExecutor, "_load", load)
        with pytest.raises(WorkerCrashed):
            model.run(x16())
        assert model.run(x16())["y"].shape == (1, 4)  # the restart fails: falls back
        (event,) = model.fallbacks
        assert event.reason.startswith("load failed: out of GPU memory")
    finally:
        model.close()


def test_fault_injection_needs_an_explicit_worker():
    with pytest.raises(ValueError, match="Isolation.WORKER"):
        Model.from_bytes(tiny_mnn(), config=CPU_1, _fault=Fault("segv"))


@pytest.fixture
def channels():
    a, b = socket.socketpair()
    yield _wire.Channel(a), b
    a.close()
    b.close()


def _frame(header: bytes, payload: bytes = b"", *, claim: int | None = None) -> bytes:
    """A raw frame; `claim` overrides the payload length the prefix announces."""
    size = len(payload) if claim is None else claim
    prefix = len(header).to_bytes(4, "little") + size.to_bytes(4, "little") + bytes(4)
    return prefix + header + payload


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (_frame(b"not json"), "not JSON"),
        (_frame(b"[1]"), "not an object"),
        (_frame(b'{"arrays":[["x","object",[1]]]}', b"12345678"), "dtype outside"),
        (_frame(b'{"arrays":[["x","float32",[4]]]}', b"1234"), "runs past"),
        (_frame(b'{"arrays":[["x","float32",[1]]]}', b"12345678"), "does not match"),
        (_frame(b'{"arrays":[["x","float32",[-1]]]}'), "bad shape"),
        (b"\xff\xff\xff\xff" + bytes(8), "too large"),
    ],
)
def test_the_parent_never_trusts_a_malformed_frame(channels, frame, message):
    channel, peer = channels
    peer.sendall(frame)
    with pytest.raises(_wire.ProtocolError, match=message):
        channel.recv(deadline=None)


def test_frames_round_trip_small_and_large(channels):
    channel, peer = channels
    other = _wire.Channel(peer)
    small = {"x": np.arange(6, dtype=np.int64).reshape(2, 3)}
    other.send({"op": "run"}, small)
    _, header, arrays = channel.recv()
    assert header["op"] == "run" and np.array_equal(arrays["x"], small["x"])
    big = np.random.default_rng(0).standard_normal((200, 100)).astype(np.float32)  # > scratch
    other.send({"ok": True}, {"y": big, "z": np.zeros(0, np.uint8)})
    _, _, arrays = channel.recv()
    assert np.array_equal(arrays["y"], big) and arrays["z"].shape == (0,)
    peer.close()
    with pytest.raises(EOFError):
        channel.recv()


def test_an_interrupted_request_never_hands_its_answer_to_the_next(model_fd):
    worker = WorkerExecutor(model_fd, CPU_1)
    try:
        first, second = x16(seed=1)["x"], x16(seed=2)["x"]
        expected = worker.run([second], True)["y"]
        channel, pid = worker._channel, worker.pid

        def interrupted(**kwargs):  # e.g. Ctrl-C while the reply is on its way
            del channel.recv
            raise KeyboardInterrupt

        channel.recv = interrupted
        with pytest.raises(KeyboardInterrupt):
            worker.run([first], True)  # the worker answers this one regardless
        np.testing.assert_array_equal(worker.run([second], True)["y"], expected)
        assert worker.pid not in (None, pid)  # the interrupted worker was replaced
    finally:
        worker.close()


def test_a_reply_to_another_request_is_a_protocol_breach(model_fd):
    worker = WorkerExecutor(model_fd, CPU_1)
    try:
        channel = worker._channel
        real_send = channel.send
        channel.send = lambda header, arrays=None, *, seq: real_send(header, arrays, seq=seq + 1)
        with pytest.raises(WorkerCrashed, match="broke the protocol") as info:
            worker.run([x16()["x"]], True)
        assert "reply to request" in info.value.event.detail
        assert worker.run([x16()["x"]], True)["y"].shape == (1, 4)  # a fresh worker
    finally:
        worker.close()


def test_a_huge_claimed_payload_costs_only_what_arrives(channels):
    channel, peer = channels
    size = (1 << 30) - 1  # within the limit, so only the allocation strategy protects
    peer.sendall(_frame(f'{{"arrays":[["x","uint8",[{size}]]]}}'.encode(), b"x" * 100, claim=size))
    peer.close()
    tracemalloc.start()
    try:
        with pytest.raises(ConnectionError, match="mid-frame"):
            channel.recv()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_payloads_beyond_the_limit_are_refused_both_ways(channels):
    a, peer = channels
    small = _wire.Channel(a.sock, max_payload=1024)
    with pytest.raises(_wire.FrameTooLarge):
        small.send({"op": "run"}, {"x": np.zeros(1025, np.uint8)})
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)  # nothing of the refused frame was sent
    peer.sendall(_frame(b"{}", claim=1025))
    with pytest.raises(_wire.ProtocolError, match="too large"):
        small.recv()
    assert a.sock.fileno() == -1  # the connection is dropped, not read on


@pytest.mark.parametrize("depth", [5_000, 100_000])  # within one read, and beyond it
def test_a_deeply_nested_header_is_a_protocol_error_and_drops_the_connection(channels, depth):
    channel, peer = channels
    peer.sendall(_frame(b"[" * depth + b"]" * depth))
    with pytest.raises(_wire.ProtocolError, match="not JSON"):
        channel.recv()
    assert channel.sock.fileno() == -1


def test_only_small_headers_are_cached(channels):
    channel, peer = channels
    other = _wire.Channel(peer)
    for i in range(3):
        other.send({"op": "run", "pad": "x" * 8192, "i": i})
        channel.recv()
    assert channel._parsed == {} and other._encoded == {}
    other.send({"op": "run"})
    channel.recv()
    assert len(channel._parsed) == 1


@pytest.mark.parametrize("isolation", ["in_process", "worker"])
def test_corrupt_model_bytes_fail_cleanly_on_every_candidate(isolation, monkeypatch):
    monkeypatch.setattr(diagnosis, "_detected", {})  # availability must be checked on these bytes
    monkeypatch.setattr(fallback, "_UNAVAILABLE", {})
    with pytest.raises(ModelFailed, match="no candidate config passed") as info:
        Model.from_bytes(os.urandom(4096), isolation=isolation)
    results = info.value.probe_results
    tried = [r for r in results if r.config.precision.name in ("NORMAL", "HIGH")]
    assert any(r.config.backend.name != "CPU" for r in tried)  # the session-check path
    for result in tried:
        assert not result.accepted and "MNN cannot load the model" in result.error


def test_the_worker_holds_no_secrets_of_the_app(monkeypatch):
    monkeypatch.setenv("SKIFF_APP_SECRET", "hunter2")
    monkeypatch.setenv("MNN_TEST_KNOB", "1")
    env = _child_env()
    assert "SKIFF_APP_SECRET" not in env and env["MNN_TEST_KNOB"] == "1"
    assert env["PATH"] == os.environ["PATH"] and str(REPO_ROOT) in env["PYTHONPATH"]


def test_a_worker_whose_parent_is_already_gone_exits_at_once():
    argv = [sys.executable, "-m", "runtime._worker_main", "--sock-fd", "0", "--model-fd", "0"]
    argv += ["--parent-pid", "1"]  # not our parent: as if the real one died before
    result = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, timeout=60)
    assert result.returncode == 1, result.stderr


def test_a_hung_worker_dies_with_its_parent_and_never_dumps_core(tmp_path):
    model = tmp_path / "model.bin"
    model.write_bytes(tiny_mnn())
    script = textwrap.dedent(
        f"""
        import threading, time, numpy as np
        from runtime.model import Model
        from runtime.worker import Fault
        data = open({str(model)!r}, "rb").read()
        m = Model.from_bytes(data, config={CPU_1.key!r}, isolation="worker",
                             deadline_s=3600, _fault=Fault("hang"))
        w = m._chain.active
        x = {{"x": np.zeros((1, 16), np.float32)}}
        threading.Thread(target=m.run, args=(x,), daemon=True).start()
        while "injected fault hang" not in w._log_tail():  # hung, never reading again
            time.sleep(0.01)
        print(w.pid, flush=True)
        threading.Event().wait()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    parent = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE)
    pid = None
    try:
        pid = int(parent.stdout.readline())
        limits = Path(f"/proc/{pid}/limits").read_text()
        assert re.search(r"Max core file size\s+0\s+0\s", limits)
        parent.kill()
        parent.wait(timeout=60)
        deadline = time.monotonic() + 30
        while _alive(pid) and time.monotonic() < deadline:  # waiting for the kernel's kill
            time.sleep(0.01)
        assert not _alive(pid)
        pid = None
    finally:
        parent.kill()
        parent.wait(timeout=60)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Tell whether `pid` runs (a zombie has exited: only its parent's wait is missing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


@pytest.mark.parametrize("text", ["segv@²", "segv@١", "segv@0", "segv@", "segv", "boom@1"])
def test_a_bad_fault_argument_is_refused_cleanly(text):
    # "²".isdigit() is True, yet int("²") raises: only ASCII digits may pass.
    with pytest.raises(SystemExit, match="bad --fault"):
        _worker_main._parse_fault(text)


def test_a_good_fault_argument_parses():
    assert _worker_main._parse_fault("segv@12") == ("segv", 12, "")
    assert _worker_main._parse_fault(f"kill@1@{CPU_1.key}") == ("kill", 1, CPU_1.key)
