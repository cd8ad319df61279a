"""Model: bytes in, named numpy outputs out, on the real MNN engine, in this process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from runtime import engine, mnn_host
from runtime.backends import DEFAULT_CONFIG, Backend
from runtime.engine import InProcessExecutor
from runtime.errors import InvalidInput, ModelFailed
from runtime.mnn_host import fd_path, sealed_memfd
from runtime.model import Isolation, Model
from tests.runtime._model_helpers import (
    CPU_1,
    CPU_1_HIGH,
    OPENCL,
    log_mnn,
    log_onnx,
    reference,
    tiny_mnn,
    tiny_onnx,
    two_input_mnn,
    x16,
)

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    with Model.from_bytes(tiny_mnn(), config=CPU_1, version="v1") as model:
        yield model


def test_outputs_match_the_onnx_reference(tiny):
    inputs = x16(seed=7)
    outputs = tiny.run(inputs)
    assert list(outputs) == ["y"]
    np.testing.assert_allclose(outputs["y"], reference(tiny_onnx(), inputs)["y"], rtol=1e-4)
    assert tiny.config == CPU_1 and tiny.actual_backend is Backend.CPU


def test_signature_is_what_mnn_reports(tiny):
    (spec,) = tiny.signature.inputs
    assert (spec.name, spec.shape, spec.dtype) == ("x", (1, 16), "float32")
    assert tiny.signature.outputs == ("y",)


def test_outputs_are_owned_by_the_caller(tiny):
    # MNN's Var.read() is a view of a buffer it reuses: the runtime must copy.
    first = tiny.run(x16(seed=1))["y"]
    kept = first.copy()
    for seed in range(2, 6):
        tiny.run(x16(seed=seed))
    np.testing.assert_array_equal(first, kept)


def test_batches_run_where_the_model_allows(tiny):
    batch = x16(seed=3, batch=5)
    outputs = tiny.run(batch)["y"]
    assert outputs.shape == (5, 4)
    np.testing.assert_allclose(outputs, reference(tiny_onnx(), batch)["y"], rtol=1e-4)
    single = tiny.run({"x": batch["x"][2:3]})["y"]
    np.testing.assert_allclose(outputs[2:3], single, rtol=1e-5)


def test_dynamic_batch_model():
    x = np.abs(np.random.default_rng(0).standard_normal((6, 8))).astype(np.float32) + 0.1
    with Model.from_bytes(log_mnn(), config=CPU_1) as model:
        for batch in (1, 6, 3):
            y = model.run({"x": x[:batch]})["y"]
            expected = reference(log_onnx(), {"x": x[:batch]})["y"]
            np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-5)


def test_several_inputs_and_outputs_by_name():
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    i = np.full((2, 3), 2, dtype=np.int32)
    with Model.from_bytes(two_input_mnn(), config=CPU_1) as model:
        assert model.signature.input_names == ("x", "i")
        out = model.run({"i": i, "x": x})  # dict order does not matter
    np.testing.assert_array_equal(out["sum"], x + 2)
    np.testing.assert_array_equal(out["sq"], x * x)


@pytest.mark.parametrize(
    ("inputs", "message"),
    [
        ({}, r"missing \['x'\]"),
        ({"x": np.zeros((1, 16), np.float32), "z": np.zeros(1)}, r"unexpected \['z'\]"),
        ({"X": np.zeros((1, 16), np.float32)}, r"missing \['x'\], unexpected \['X'\]"),
        ({"x": [[0.0] * 16]}, "must be a numpy.ndarray, not list"),
        ({"x": np.zeros((1, 16), np.float64)}, "dtype float64; the model takes float32"),
        ({"x": np.zeros((1, 16), np.int32)}, "dtype int32"),
        ({"x": np.zeros((16,), np.float32)}, "takes rank 2"),
        ({"x": np.zeros((0, 16), np.float32)}, "empty dimension"),
        ({"x": np.zeros((1, 17), np.float32)}, r"cannot run these shapes \(x \(1, 17\)"),
    ],
)
def test_invalid_inputs_are_named(tiny, inputs, message):
    with pytest.raises(InvalidInput, match=message):
        tiny.run(inputs)
    assert not tiny.failed and tiny.fallbacks == ()  # never the config's fault


class _FailingModule:
    """An MNN module whose backend fails every request, as one out of memory would."""

    def forward(self, feeds):
        raise RuntimeError("backend ran out of memory")


def test_a_backend_failure_at_a_new_shape_is_the_configs_not_the_callers():
    with Model.from_bytes(tiny_mnn(), config=CPU_1_HIGH) as model:
        model._chain.active._module = _FailingModule()
        outputs = model.run(x16(batch=3))  # a batch size never seen before
        assert outputs["y"].shape == (3, 4) and model.config == DEFAULT_CONFIG
        (event,) = model.fallbacks
        assert event.from_config == CPU_1_HIGH and "out of memory" in event.reason


def test_remembered_shapes_are_the_most_recently_used(monkeypatch):
    fd = sealed_memfd(tiny_mnn())
    executor = InProcessExecutor(fd_path(fd), CPU_1)
    try:
        limit = engine._SHAPE_MEMORY
        for batch in range(1, limit + 7):
            executor.run([np.zeros((batch, 16), np.float32)], False)
        captures = []
        real = mnn_host.native_output
        monkeypatch.setattr(mnn_host, "native_output", lambda: captures.append(1) or real())
        executor.run([np.zeros((limit + 6, 16), np.float32)], False)  # the newest shape
        executor.run([np.zeros((7, 16), np.float32)], False)  # the oldest one remembered
        assert captures == []
        executor.run([np.zeros((6, 16), np.float32)], False)  # forgotten
        assert captures == [1]
    finally:
        executor.close()
        os.close(fd)


def test_non_contiguous_inputs_are_fine(tiny):
    wide = np.random.default_rng(0).standard_normal((1, 32)).astype(np.float32)
    strided = wide[:, ::2]
    assert not strided.flags.c_contiguous
    np.testing.assert_array_equal(
        tiny.run({"x": strided})["y"], tiny.run({"x": strided.copy()})["y"]
    )


def test_every_inference_is_recorded(tiny):
    before = tiny.histogram.count
    for seed in range(20):
        tiny.run(x16(seed=seed))
    assert tiny.histogram.count == before + 20
    assert tiny.histogram.quantile(0.5) > 0
    report = json.loads(json.dumps(tiny.telemetry()))
    assert report["config"] == CPU_1.key and report["actual_backend"] == "CPU"
    assert report["latency"]["count"] == tiny.histogram.count


def test_forced_unavailable_backend_falls_back_to_the_cpu_and_says_so():
    with Model.from_bytes(tiny_mnn(), config=OPENCL) as model:
        assert model.config == DEFAULT_CONFIG and model.actual_backend is Backend.CPU
        (event,) = model.fallbacks
        assert event.from_config == OPENCL and event.to_config == DEFAULT_CONFIG
        assert "OPENCL is not available here" in event.reason and "CPU" in event.reason
        model.run(x16())


def test_bytes_that_are_no_model_fail_cleanly():
    with pytest.raises(ModelFailed, match="failed to start") as info:
        Model.from_bytes(os.urandom(4096), config=CPU_1)
    assert info.value.fallbacks and "load failed" in info.value.fallbacks[-1].reason


def test_closed_model_refuses_requests():
    model = Model.from_bytes(tiny_mnn(), config=CPU_1)
    model.close()
    model.close()  # idempotent
    with pytest.raises(ModelFailed, match="closed"):
        model.run(x16())


def test_plaintext_lives_in_a_sealed_memfd(tiny):
    fd = tiny._fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:skiff-model-v1")
    assert os.pread(fd, 16, 0) == tiny_mnn()[:16]
    with pytest.raises(PermissionError):
        os.pwrite(fd, b"x", 0)


def test_stdout_stays_clean_and_nothing_is_written(tmp_path):
    """A child app's stdout carries only its own output; no file appears anywhere."""
    model = tmp_path / "model.bin"
    model.write_bytes(tiny_mnn())  # the test's own copy: the app gets bytes, as if decrypted
    work = tmp_path / "cwd"
    work.mkdir()
    script = textwrap.dedent(
        f"""
        import importlib.util, numpy as np
        from runtime.backends import BackendConfig
        from runtime.model import Model
        data = open({str(model)!r}, "rb").read()
        # OPENCL makes MNN print its fallback line: it must not reach stdout.
        keys = [{OPENCL.key!r}, {CPU_1.key!r}]
        m = Model.from_bytes(data, candidates=[BackendConfig.from_key(k) for k in keys])
        m.run({{"x": np.zeros((1, 16), np.float32)}})
        try:
            importlib.util.find_spec("MNN.tools")  # finds without importing, unless blocked
            print("MNN.tools reachable")
        except ImportError:
            print("app output")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TMPDIR": str(work)}
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=work, env=env, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == "app output\n"
    assert list(work.iterdir()) == []


def test_another_threads_stdout_is_not_lost_during_loads(tmp_path):
    """Output an app writes to stdout while MNN loads reaches stdout, all of it, in order."""
    model = tmp_path / "model.bin"
    model.write_bytes(tiny_mnn())
    script = textwrap.dedent(
        f"""
        import contextlib, os, sys, threading
        from runtime import mnn_host
        from runtime.backends import BackendConfig
        from runtime.model import Model
        inside, wrote, stop = threading.Event(), threading.Event(), threading.Event()
        real = mnn_host.native_output

        @contextlib.contextmanager
        def held_open():  # hold every capture open until the app has written inside it
            with real() as captured:
                wrote.clear()
                inside.set()
                wrote.wait(30)
                inside.clear()
                yield captured

        mnn_host.native_output = held_open

        def app():
            n = 0
            while not stop.is_set():
                print(f"line {{n}}", flush=True)
                os.write(1, f"raw {{n}}\\n".encode())
                n += 1
                if inside.is_set():
                    wrote.set()
            print(f"last {{n}}", flush=True)

        writer = threading.Thread(target=app)
        writer.start()
        data = open({str(model)!r}, "rb").read()
        keys = [{OPENCL.key!r}, {CPU_1.key!r}]  # OPENCL makes MNN print its fallback line
        for _ in range(3):
            Model.from_bytes(data, candidates=[BackendConfig.from_key(k) for k in keys]).close()
        stop.set()
        writer.join()
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    count = int(lines[-1].removeprefix("last "))
    assert count > 0
    expected = [f"{kind} {n}" for n in range(count) for kind in ("line", "raw")]
    assert lines[:-1] == expected  # nothing lost, nothing reordered, no MNN line among them


def test_works_in_a_daemon_without_stdout(tmp_path):
    # With fd 1 closed, new descriptors could take its number; capturing MNN's stdout
    # must not clobber the model's memfd then.
    model = tmp_path / "model.bin"
    model.write_bytes(tiny_mnn())
    script = textwrap.dedent(
        f"""
        import os, sys, numpy as np
        os.close(1)
        from runtime.backends import BackendConfig
        from runtime.model import Model
        keys = [{OPENCL.key!r}, {CPU_1.key!r}]
        candidates = [BackendConfig.from_key(k) for k in keys]
        m = Model.from_bytes(open({str(model)!r}, "rb").read(), candidates=candidates)
        y = m.run({{"x": np.ones((1, 16), np.float32)}})["y"]
        sys.stderr.write(f"{{y.shape}} {{os.path.exists('/proc/self/fd/1')}}")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stderr.endswith("(1, 4) False")


def test_isolation_is_typed():
    assert Isolation("worker") is Isolation.WORKER
    with pytest.raises(ValueError):
        Model.from_bytes(tiny_mnn(), config=CPU_1, isolation="thread")
