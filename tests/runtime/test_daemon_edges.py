"""What a review found a daemon could hit, each reproduced and fixed.

A worker killed while it restarts, deadlines that bound nothing, a fork during a stdout
capture, a printf racing a capture, shape hints asking for gigabytes, golden data whose
tolerance switches the check off.
"""

from __future__ import annotations

import ctypes
import io
import json
import math
import os
import signal
import threading
import time
import zipfile

import numpy as np
import pytest

from runtime import Model
from runtime._stdio import capture_c_stdout, swaps_file_pointer
from runtime.errors import InvalidInput, WorkerCrashed
from runtime.golden import Golden, Tolerance
from tests.runtime._model_helpers import CPU_1, tiny_mnn, x16


def test_a_worker_killed_while_it_restarts_counts_as_one_crash():
    with Model.from_bytes(
        tiny_mnn(), config=CPU_1, isolation="worker", deadline_s=10, crash_limit=3
    ) as model:
        executor = model._chain.active
        first = executor.pid
        os.kill(first, signal.SIGKILL)  # dies while idle (the OOM killer)...
        time.sleep(0.3)
        killed = []

        def kill_the_replacement():  # ...and kills its replacement while it loads
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                proc = executor._proc
                if proc is not None and proc.pid != first:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed.append(proc.pid)
                    return
                time.sleep(0.0005)

        killer = threading.Thread(target=kill_the_replacement)
        killer.start()
        with pytest.raises(WorkerCrashed):
            model.run(x16())
        killer.join()
        assert killed
        # Counted as one crash, not a failed load that retires the config at once.
        assert len(model.crashes) == 1 and not model.fallbacks
        assert model.run(x16())["y"].shape == (1, 4)


@pytest.mark.parametrize("deadline", [0, -1, math.nan, math.inf, 1e12, True, "5"])
def test_deadlines_that_bound_nothing_are_refused(deadline):
    with pytest.raises(ValueError, match="deadline_s must be a number of seconds"):
        Model.from_bytes(tiny_mnn(), config=CPU_1, deadline_s=deadline)


def test_shape_hints_asking_for_gigabytes_are_refused():
    with pytest.raises(InvalidInput, match="elements in all; the limit is"):
        Model.from_bytes(tiny_mnn(), config=CPU_1, input_shapes={"x": (1 << 26, 8)})


@pytest.mark.skipif(not swaps_file_pointer(), reason="captures swap fd 1 off glibc")
def test_a_fork_during_a_capture_leaves_the_child_a_working_stdout():
    Model.from_bytes(tiny_mnn(), config=CPU_1).close()  # MNN loaded, capture stream made
    libc = ctypes.CDLL(None)
    stop = threading.Event()

    def capturing():
        while not stop.is_set():
            with capture_c_stdout():
                time.sleep(0.001)

    thread = threading.Thread(target=capturing, daemon=True)
    thread.start()
    try:
        for _ in range(5):
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: C stdout must be its own, and captures must work
                os.close(read)
                os.dup2(write, 1)
                libc.printf(b"child printf\n")
                libc.fflush(None)
                signal.alarm(20)
                with capture_c_stdout() as captured:
                    libc.printf(b"captured in the child\n")
                    libc.fflush(None)
                os.write(1, captured.text.encode())
                os._exit(0)
            os.close(write)
            _, status = os.waitpid(pid, 0)
            with os.fdopen(read, "rb") as f:
                out = f.read()
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
            assert out == b"child printf\ncaptured in the child\n"
    finally:
        stop.set()
        thread.join()


@pytest.mark.skipif(not swaps_file_pointer(), reason="captures swap fd 1 off glibc")
def test_a_capture_keeps_its_own_output_while_another_thread_prints():
    libc = ctypes.CDLL(None)
    stop = threading.Event()

    def printing():  # some other C library printing on another thread
        while not stop.is_set():
            libc.printf(b"%s\n", b"y" * 3000)

    thread = threading.Thread(target=printing, daemon=True)
    thread.start()
    lost, i, until = [], 0, time.monotonic() + 3  # the race is rare: tens of thousands
    try:
        while time.monotonic() < until:
            i += 1
            with capture_c_stdout() as captured:
                libc.printf(b"MARKER %d\n", i)
            if f"MARKER {i}\n" not in captured.text:
                lost.append(i)
    finally:
        stop.set()
        thread.join()
    assert lost == []


def _golden_with_meta(meta: bytes) -> bytes:
    good = Golden({"x": np.ones((1, 16), np.float32)}, {"y": np.ones((1, 4), np.float32)})
    buffer = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(good.to_npz())) as src, zipfile.ZipFile(buffer, "w") as dst:
        for info in src.infolist():
            if info.filename != "meta.npy":
                dst.writestr(info, src.read(info))
        array = io.BytesIO()
        np.save(array, np.frombuffer(meta, np.uint8))
        dst.writestr("meta.npy", array.getvalue())
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("tolerance", "problem"),
    [
        ('{"min_cosine": NaN}', "min_cosine must be in"),
        ('{"min_cosine": -Infinity}', "min_cosine must be in"),
        ('{"min_cosine": 0.9, "max_abs_error": NaN}', "max_abs_error must be finite"),
        ('{"min_cosine": 1' + "0" * 400 + "}", "malformed meta: OverflowError"),
    ],
)
def test_golden_tolerances_that_switch_the_check_off_are_refused(tolerance, problem):
    meta = f'{{"format": "skiff-golden/1", "tolerance": {tolerance}}}'.encode()
    with pytest.raises(ValueError, match=problem):
        Golden.from_npz(_golden_with_meta(meta))


def test_deeply_nested_golden_meta_is_a_value_error():
    meta = b'{"format": "skiff-golden/1", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(ValueError, match="malformed meta: RecursionError"):
        Golden.from_npz(_golden_with_meta(meta))
    with pytest.raises(ValueError, match="min_cosine must be in"):
        Tolerance(min_cosine=math.nan)
    assert json.loads(json.dumps(Tolerance().to_dict())) == {
        "min_cosine": 0.999,
        "max_abs_error": None,
    }
