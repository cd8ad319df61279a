"""Probing candidate configs with golden data on the real engine, and the golden format."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import zipfile

import numpy as np
import pytest

from runtime import _mnn_diagnosis
from runtime.backends import Backend, BackendConfig, candidate_configs
from runtime.engine import InProcessExecutor
from runtime.errors import BackendUnavailable, ModelFailed
from runtime.golden import Golden, Tolerance
from runtime.mnn_host import fd_path, sealed_memfd
from runtime.model import Model
from runtime.probe import ProbeResult, probe_config, rank
from runtime.signature import Signature, TensorSpec
from tests.runtime._model_helpers import (
    CPU_1,
    CPU_1_HIGH,
    CPU_1_LOW,
    OPENCL,
    log_mnn,
    reference,
    tiny_mnn,
    tiny_onnx,
    x16,
)


@pytest.fixture(scope="module")
def golden() -> Golden:
    return Golden.make(tiny_mnn(), x16(seed=11, batch=4), isolated=False)


def test_golden_references_come_from_the_reference_config(golden):
    expected = reference(tiny_onnx(), dict(golden.inputs))["y"]
    np.testing.assert_allclose(golden.outputs["y"], expected, rtol=1e-4)


def test_golden_is_made_in_a_worker_by_default(golden):
    # The control plane makes golden data: MNN must not run in its process.
    isolated = Golden.make(tiny_mnn(), dict(golden.inputs))
    np.testing.assert_array_equal(isolated.outputs["y"], golden.outputs["y"])


def test_golden_npz_round_trip(golden):
    strict = Golden(golden.inputs, golden.outputs, Tolerance(0.9999, 1e-3))
    again = Golden.from_npz(strict.to_npz())
    assert again.tolerance == Tolerance(0.9999, 1e-3)
    np.testing.assert_array_equal(again.inputs["x"], golden.inputs["x"])
    np.testing.assert_array_equal(again.outputs["y"], golden.outputs["y"])


def _npz(meta: bytes | None = None, **arrays) -> bytes:
    """An .npz with `arrays` (named with "/" as "__") and, if given, a raw meta entry."""
    named = {k.replace("__", "/"): v for k, v in arrays.items()}
    if meta is not None:
        named["meta"] = np.frombuffer(meta, np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, **named)
    return buffer.getvalue()


VALID_META = json.dumps({"format": "skiff-golden/1", "tolerance": {}}).encode()


def test_golden_npz_refuses_pickles_and_foreign_files(golden):
    pickled = _npz(VALID_META, input__x=np.array([object()], dtype=object), output__y=np.ones(2))
    with pytest.raises(ValueError, match="holds Python objects"):
        Golden.from_npz(pickled)
    with pytest.raises(ValueError, match="not a valid .npz"):
        Golden.from_npz(b"not a zip")
    buffer = io.BytesIO()
    np.savez(buffer, **{"input/x": np.ones(2), "output/y": np.ones(2)})
    with pytest.raises(ValueError, match="format"):
        Golden.from_npz(buffer.getvalue())
    assert zipfile.is_zipfile(io.BytesIO(golden.to_npz()))


@pytest.mark.parametrize(
    "meta",
    [
        b"[1]",
        b'{"format": "skiff-golden/1", "tolerance": [1]}',
        b'{"format": "skiff-golden/1", "tolerance": {"min_cosine": [1]}}',
        b"\xff",
    ],
)
def test_malformed_golden_meta_is_a_value_error(meta):
    with pytest.raises(ValueError):
        Golden.from_npz(_npz(meta, input__x=np.ones(2), output__y=np.ones(2)))


def test_golden_needs_finite_references():
    with pytest.raises(ValueError, match="not finite"):
        Golden({"x": np.ones(2, np.float32)}, {"y": np.array([1.0, np.nan], np.float32)})


def test_compare_reports_cosine_and_max_abs_error():
    ref = np.array([[1.0, 2.0, 3.0]], np.float32)
    golden = Golden({"x": ref}, {"y": ref}, Tolerance(0.99, 0.5))
    ok = golden.compare({"y": ref + 0.1})
    assert ok.accepted and ok.max_abs_error == pytest.approx(0.1, rel=1e-5)
    assert ok.cosine == pytest.approx(1.0, abs=1e-3)
    far = golden.compare({"y": ref + 1.0})
    assert not far.accepted and "max abs error" in far.problem
    flipped = golden.compare({"y": -ref})
    assert flipped.cosine == pytest.approx(-1.0) and "cosine" in flipped.problem
    nan = golden.compare({"y": np.array([[1.0, np.nan, 3.0]], np.float32)})
    assert not nan.finite and not nan.accepted
    assert "shape" in golden.compare({"y": ref[0]}).problem


def test_probe_reports_what_actually_ran(golden):
    candidates = [CPU_1, CPU_1_LOW, OPENCL, BackendConfig(Backend.VULKAN, threads=4)]
    with Model.from_bytes(tiny_mnn(), golden=golden, candidates=candidates) as model:
        results = {r.config: r for r in model.probe_results}
        assert set(results) == set(candidates)
        for config in (OPENCL, BackendConfig(Backend.VULKAN, threads=4)):
            result = results[config]
            # The wheel has no GPU backends: MNN silently ran them on the CPU.
            assert not result.accepted and result.actual_backend is Backend.CPU
            assert "not available" in result.error and result.p50_us is None
        for config in (CPU_1, CPU_1_LOW):
            result = results[config]
            assert result.accepted and result.actual_backend is Backend.CPU
            assert result.cosine > 0.9999 and result.max_abs_error < 1e-3
            assert len(result.samples_us) == 10
            assert result.p50_us <= result.p95_us <= result.p99_us
        assert model.config in (CPU_1, CPU_1_LOW)
        assert model.actual_backend is Backend.CPU
        json.dumps([r.to_dict() for r in model.probe_results])  # telemetry-ready


def test_default_candidates_never_pick_an_unavailable_backend(golden):
    with Model.from_bytes(tiny_mnn(), golden=golden, probe_runs=3) as model:
        assert len(model.probe_results) == len(candidate_configs())
        accepted = [r for r in model.probe_results if r.accepted]
        assert accepted and all(r.config.backend is Backend.CPU for r in accepted)
        assert all(r.actual_backend in (Backend.CPU, None) for r in model.probe_results)


def test_a_winner_reloaded_after_the_probe_is_probed_once(golden, monkeypatch):
    # Ranking within timing noise is relative to the fastest: a third config can move the
    # lead back to the second one after the first was kept loaded. The chain loads the
    # winner again, and its probe results still hold one entry per candidate.
    import runtime.fallback

    p50s = {CPU_1: 100.0, CPU_1_LOW: 96.0, CPU_1_HIGH: 92.0}
    real = runtime.fallback.probe_config

    def scripted(make, config, *args, **kwargs):
        result, executor = real(make, config, *args, **kwargs)
        return dataclasses.replace(result, p50_us=p50s[config]), executor

    monkeypatch.setattr(runtime.fallback, "probe_config", scripted)
    candidates = [CPU_1, CPU_1_LOW, CPU_1_HIGH]
    assert [
        r.config for r in rank([ProbeResult(c, Backend.CPU, True, p50) for c, p50 in p50s.items()])
    ] == [CPU_1_LOW, CPU_1_HIGH, CPU_1]
    with Model.from_bytes(tiny_mnn(), golden=golden, candidates=candidates) as model:
        assert [r.config for r in model.probe_results] == candidates
        assert model.config == CPU_1_LOW and model.fallbacks == ()
        assert model.run(golden.inputs)["y"].shape == golden.outputs["y"].shape


def test_outputs_that_do_not_match_the_golden_data_reject_every_config(golden):
    # Same direction (cosine 1), wrong magnitude: only the absolute bound catches it.
    wrong = Golden(golden.inputs, {"y": golden.outputs["y"] * 1.5}, Tolerance(0.99, 0.1))
    with pytest.raises(ModelFailed, match="no candidate config passed") as info:
        Model.from_bytes(tiny_mnn(), golden=wrong, candidates=[CPU_1, CPU_1_LOW])
    results = info.value.probe_results
    assert len(results) == 2 and not any(r.accepted for r in results)
    assert all("rejected: max abs error" in r.error for r in results)


def test_golden_inputs_that_do_not_fit_the_model(golden):
    misfit = Golden({"x": np.ones((1, 15), np.float32)}, dict(golden.outputs))
    with pytest.raises(ModelFailed) as info:
        Model.from_bytes(tiny_mnn(), golden=misfit, candidates=[CPU_1])
    assert "golden inputs do not fit" in info.value.probe_results[0].error


def test_forced_config_is_checked_against_the_golden_data(golden):
    with Model.from_bytes(tiny_mnn(), golden=golden.to_npz(), config=CPU_1_HIGH.key) as model:
        assert model.config == CPU_1_HIGH
        (result,) = model.probe_results
        assert result.accepted and result.config == CPU_1_HIGH and model.fallbacks == ()


def test_without_golden_data_non_finite_outputs_on_zeros_do_not_reject():
    # log(0) is -inf: zeros say nothing about whether a config works.
    with Model.from_bytes(log_mnn(), candidates=[CPU_1, CPU_1_LOW]) as model:
        assert model.config == CPU_1
        results = {r.config: r for r in model.probe_results}
        assert results[CPU_1].accepted and results[CPU_1].error is None
        low = results[CPU_1_LOW]
        assert not low.accepted and "needs golden data" in low.error
        x = np.abs(np.random.default_rng(0).standard_normal((2, 8))).astype(np.float32)
        assert np.isfinite(model.run({"x": x + 0.1})["y"]).all()


def test_probe_closes_the_executor_when_interrupted():
    class Interrupted:
        config, actual_backend, load_ms, closed = CPU_1, Backend.CPU, 0.0, False
        signature = Signature((TensorSpec("x", (1, 16), "float32"),), ("y",))

        def run(self, arrays, exact):
            raise KeyboardInterrupt

        def close(self):
            self.closed = True

    executor = Interrupted()
    with pytest.raises(KeyboardInterrupt):
        probe_config(lambda config: executor, CPU_1, None)
    assert executor.closed


def test_rank_prefers_the_fastest_beyond_timing_noise():
    def result(config, p50):
        return ProbeResult(config, Backend.CPU, True, p50_us=p50)

    a, b, c = result(CPU_1, 100.0), result(CPU_1_LOW, 98.0), result(CPU_1_HIGH, 50.0)
    assert [r.config for r in rank([a, b])] == [CPU_1, CPU_1_LOW]  # 2% apart: keep order
    assert [r.config for r in rank([a, b, c])] == [CPU_1_HIGH, CPU_1_LOW, CPU_1]
    assert rank([ProbeResult(CPU_1, None, False, error="x")]) == []


def test_a_fallback_the_load_logs_needs_no_extra_session(monkeypatch):
    fd = sealed_memfd(tiny_mnn())
    sessions = []
    monkeypatch.setattr(_mnn_diagnosis, "_detected", {})
    monkeypatch.setattr(_mnn_diagnosis, "_session_backend", lambda *args: sessions.append(args))
    try:
        with pytest.raises(BackendUnavailable, match="Can't Find type=3 backend") as info:
            InProcessExecutor(fd_path(fd), OPENCL)
        assert info.value.actual is Backend.CPU and sessions == []
    finally:
        os.close(fd)


def test_detection_reads_both_the_log_and_the_session():
    fd = sealed_memfd(tiny_mnn())
    try:
        path = fd_path(fd)
        _mnn_diagnosis._detected.clear()
        actual, evidence = _mnn_diagnosis.detect_backend(path, OPENCL)
        assert actual is Backend.CPU
        # Both signals: MNN's fallback line, and the forward type its session reports
        # (13 is MNN_FORWARD_CPU_EXTENSION: the CPU with AVX2).
        assert "Can't Find type=3 backend" in evidence
        assert "session reports forward type 13 (CPU)" in evidence
        logged = "Can't Find type=3 backend, use 0 instead\n"
        assert _mnn_diagnosis.detect_backend(path, OPENCL, logged)[1].startswith("MNN log")
        assert _mnn_diagnosis.detect_backend(path, CPU_1)[0] is Backend.CPU
        with pytest.raises(BackendUnavailable) as info:
            InProcessExecutor(path, OPENCL)
        assert info.value.actual is Backend.CPU
    finally:
        os.close(fd)
