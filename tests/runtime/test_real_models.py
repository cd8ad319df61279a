"""Real third-party models (PP-OCRv4, Silero VAD): dynamic shapes load, run and match onnxruntime.

The ONNX files come from installed PyPI packages (`control_plane.demo.third_party_models`)
and are converted once per session with MNN's converter. The reference is onnxruntime
on the same inputs.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import onnxruntime as ort
import pytest

from control_plane.demo.sample_models import onnx_to_mnn_bytes
from control_plane.demo.third_party_models import THIRD_PARTY_MODELS, by_name
from runtime.errors import InvalidInput
from runtime.golden import Golden, Tolerance
from runtime.model import Isolation, Model
from tests.runtime._model_helpers import CPU_1, CPU_1_HIGH, CPU_1_LOW

NAMES = [m.name for m in THIRD_PARTY_MODELS]
MIN_COSINE = 0.998


@functools.cache
def mnn_bytes(name: str) -> bytes:
    return onnx_to_mnn_bytes(by_name(name).path.read_bytes())


@functools.cache
def session(name: str) -> ort.InferenceSession:
    return ort.InferenceSession(str(by_name(name).path), providers=["CPUExecutionProvider"])


def onnxruntime(name: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = session(name)
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(None, inputs), strict=True))


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def assert_matches(name: str, outputs: dict, inputs: dict) -> None:
    expected = onnxruntime(name, inputs)
    assert list(outputs) == list(expected)
    for key, reference in expected.items():
        assert outputs[key].shape == reference.shape, key
        assert cosine(outputs[key], reference) >= MIN_COSINE, key


@pytest.mark.parametrize("name", NAMES)
def test_loads_without_golden_data_or_hints_and_matches_onnxruntime(name):
    # Before: ValueError("negative dimensions are not allowed") from the probe's zeros.
    with Model.from_bytes(mnn_bytes(name), candidates=[CPU_1, CPU_1_LOW]) as model:
        assert model.config == CPU_1
        assert "not timed" in model.probe_untimed
        report = json.loads(json.dumps(model.telemetry()))
        assert report["probe_untimed"] == model.probe_untimed
        first = report["probe_results"][0]
        assert first["accepted"] and first["p50_us"] is None and "not timed" in first["untimed"]
        inputs = by_name(name).golden_inputs()
        assert_matches(name, model.run(inputs), inputs)


def test_the_untimed_reason_names_the_input_and_the_way_out():
    with Model.from_bytes(mnn_bytes("ppocr-det"), candidates=[CPU_1]) as model:
        assert "'x' has dynamic dims (1, 3, -1, -1)" in model.probe_untimed
        assert "input_shapes" in model.probe_untimed
    # Shapes given, yet the sample rate is an integer: zero may crash MNN (it does).
    hints = by_name("silero-vad").input_shapes
    with Model.from_bytes(mnn_bytes("silero-vad"), candidates=[CPU_1], input_shapes=hints) as m:
        assert "integer input 'sr' needs golden data" in m.probe_untimed


def test_shape_hints_let_the_probe_time_the_candidates():
    det = by_name("ppocr-det")
    with Model.from_bytes(
        mnn_bytes("ppocr-det"), candidates=[CPU_1], input_shapes=det.input_shapes, probe_runs=2
    ) as model:
        (result,) = model.probe_results
        assert result.accepted and result.p50_us > 0 and result.untimed is None
        assert model.probe_untimed is None


@pytest.mark.parametrize(
    ("hints", "message"),
    [
        ({"image": (1, 3, 32, 32)}, "names 'image', which the model does not take"),
        ({"x": (1, 3, 32)}, "takes rank 4"),
        ({"x": (1, 3, -1, 32)}, "must be positive ints"),
        ({"x": "1,3,32,32"}, "must be positive ints"),
    ],
)
def test_bad_shape_hints_are_refused_by_name(hints, message):
    with pytest.raises(InvalidInput, match=message):
        Model.from_bytes(mnn_bytes("ppocr-cls"), candidates=[CPU_1], input_shapes=hints)


def test_publisher_golden_data_probes_every_candidate():
    name = "ppocr-rec"
    inputs = by_name(name).golden_inputs()
    golden = Golden(inputs, onnxruntime(name, inputs), Tolerance(MIN_COSINE))
    candidates = [CPU_1, CPU_1_LOW, CPU_1_HIGH]
    with Model.from_bytes(mnn_bytes(name), golden=golden, candidates=candidates) as model:
        assert model.probe_untimed is None
        judged = {r.config: r for r in model.probe_results}
        assert set(judged) == set(candidates)  # LOW too: golden data can judge it
        assert judged[CPU_1].accepted and judged[CPU_1].cosine >= MIN_COSINE
        assert judged[CPU_1].p50_us > 0


def test_a_model_with_an_integer_input_probes_on_golden_data():
    name = "silero-vad"
    inputs = by_name(name).golden_inputs()  # sr is int64, as onnxruntime takes it
    golden = Golden(inputs, onnxruntime(name, inputs), Tolerance(MIN_COSINE))
    with Model.from_bytes(mnn_bytes(name), golden=golden, candidates=[CPU_1]) as model:
        (result,) = model.probe_results
        assert result.accepted and result.untimed is None and result.cosine >= MIN_COSINE


def _det(h: int, w: int) -> dict[str, np.ndarray]:
    """A page of text-like strokes of any size (random noise gives an all-but-zero map)."""
    page = by_name("ppocr-det").golden_inputs()["x"]  # (1, 3, 320, 320)
    return {"x": np.ascontiguousarray(np.tile(page, (1, 1, 2, 2))[:, :, :h, :w])}


def _vad(batch: int, samples: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(batch * samples)
    return {
        "input": (0.1 * rng.standard_normal((batch, samples))).astype(np.float32),
        "state": (0.1 * rng.standard_normal((2, batch, 128))).astype(np.float32),
        "sr": np.array(16000 if samples == 512 else 8000, np.int64),
    }


@pytest.mark.parametrize("isolation", [Isolation.IN_PROCESS, Isolation.WORKER])
def test_every_valid_shape_runs_one_after_another(isolation):
    options = {"config": CPU_1, "isolation": isolation}
    with Model.from_bytes(mnn_bytes("ppocr-det"), **options) as model:
        for h, w in ((320, 320), (480, 640), (320, 320), (64, 96)):
            assert_matches("ppocr-det", model.run(_det(h, w)), _det(h, w))
    with Model.from_bytes(mnn_bytes("silero-vad"), **options) as model:
        for batch, samples in ((1, 512), (2, 512), (1, 256), (3, 512), (2, 256)):
            inputs = _vad(batch, samples)
            assert_matches("silero-vad", model.run(inputs), inputs)


def test_int64_values_beyond_int32_are_refused_not_wrapped():
    inputs = {**_vad(1, 512), "sr": np.array(2**32 + 16000, np.int64)}  # wraps to 16000
    with Model.from_bytes(mnn_bytes("silero-vad"), config=CPU_1) as model:
        with pytest.raises(InvalidInput, match="'sr' holds int64 values outside int32"):
            model.run(inputs)
        with pytest.raises(InvalidInput, match="'sr' has dtype float32"):
            model.run({**inputs, "sr": np.array(16000, np.float32)})
