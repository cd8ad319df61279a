"""Crash isolation: a worker that dies or hangs takes only itself down, deterministically.

The faults are real (a NULL read for SIGSEGV, abort(), SIGKILL as the OOM killer sends,
a wait that never ends) and fire on a given request number, so no test races a crash:
a dead worker closes its socket, and the parent's blocked read returns at once.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from runtime import _wire
from runtime._memfd import sealed_memfd
from runtime.errors import InvalidInput, WorkerCrashed
from runtime.model import Isolation, Model
from runtime.worker import Fault, WorkerExecutor
from tests.runtime._model_helpers import CPU_1, CPU_1_LOW, reference, tiny_mnn, tiny_onnx, x16

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
        assert model._chain.active.pid not in (None, pid)  # restarted right away
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


def test_fault_injection_needs_an_explicit_worker():
    with pytest.raises(ValueError, match="Isolation.WORKER"):
        Model.from_bytes(tiny_mnn(), config=CPU_1, _fault=Fault("segv"))


@pytest.fixture
def channels():
    a, b = socket.socketpair()
    yield _wire.Channel(a), b
    a.close()
    b.close()


def _frame(header: bytes, payload: bytes = b"") -> bytes:
    return len(header).to_bytes(4, "little") + len(payload).to_bytes(4, "little") + header + payload


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (_frame(b"not json"), "not JSON"),
        (_frame(b"[1]"), "not an object"),
        (_frame(b'{"arrays":[["x","object",[1]]]}', b"12345678"), "dtype outside"),
        (_frame(b'{"arrays":[["x","float32",[4]]]}', b"1234"), "runs past"),
        (_frame(b'{"arrays":[["x","float32",[1]]]}', b"12345678"), "does not match"),
        (_frame(b'{"arrays":[["x","float32",[-1]]]}'), "bad shape"),
        (b"\xff\xff\xff\xff\x00\x00\x00\x00", "too large"),
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
    header, arrays = channel.recv()
    assert header["op"] == "run" and np.array_equal(arrays["x"], small["x"])
    big = np.random.default_rng(0).standard_normal((200, 100)).astype(np.float32)  # > scratch
    other.send({"ok": True}, {"y": big, "z": np.zeros(0, np.uint8)})
    _, arrays = channel.recv()
    assert np.array_equal(arrays["y"], big) and arrays["z"].shape == (0,)
    peer.close()
    with pytest.raises(EOFError):
        channel.recv()
