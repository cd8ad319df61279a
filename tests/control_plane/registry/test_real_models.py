"""Real third-party models through a push: golden data, real signatures, honest variants.

PP-OCRv4's detector, recogniser and direction classifier (rapidocr-onnxruntime) and Silero
VAD (silero-vad: state inputs, an If on the sample rate), from their installed package
data. Each is pushed over gRPC the way a publisher would, and what the registry stored
is checked against onnxruntime running the original ONNX file on the same inputs.
"""

from __future__ import annotations

import io

import numpy as np
import onnxruntime as ort
import pytest

from contract import errors
from control_plane.demo.third_party_models import THIRD_PARTY_MODELS, by_name
from runtime.golden import Golden
from tests.control_plane.helpers import start_control_plane

# fp32 through MNN against onnxruntime: the same graph, different kernels.
FP32_COSINE = 0.998


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    plane = start_control_plane(tmp_path_factory.mktemp("real") / "home")
    yield plane
    plane.stop()


def _onnxruntime(model, inputs: dict[str, np.ndarray]) -> list[np.ndarray]:
    session = ort.InferenceSession(str(model.path), providers=["CPUExecutionProvider"])
    feeds = {i.name: inputs[i.name] for i in session.get_inputs()}
    return session.run(None, feeds)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _npz(tmp_path, arrays: dict[str, np.ndarray]):
    path = tmp_path / "golden.npz"
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    path.write_bytes(buffer.getvalue())
    return path


@pytest.mark.parametrize("model", THIRD_PARTY_MODELS, ids=lambda m: m.name)
def test_seeded_golden_outputs_match_onnxruntime(cp, model):
    """No golden file: the shapes and ranges a publisher declares are enough."""
    with cp.client() as client:
        version = client.push(
            model.path,
            name=model.name,
            input_shapes=model.input_shapes,
            input_ranges=model.input_ranges,
        )
    assert version.golden.source == "seeded"
    # The output signature comes from a real run: real shapes and dtypes.
    stored_outputs = {t.name: (tuple(t.shape), t.dtype) for t in version.signature.outputs}
    _, data = cp.registry.golden(model.name, version.version)
    golden = Golden.from_npz(data)
    reference = _onnxruntime(model, {k: _onnx_dtype(k, v, model) for k, v in golden.inputs.items()})
    assert list(golden.outputs) == list(stored_outputs)
    for (name, ours), theirs in zip(golden.outputs.items(), reference, strict=True):
        assert stored_outputs[name] == (ours.shape, "float32")
        assert ours.shape == theirs.shape
        assert _cosine(ours, theirs) >= FP32_COSINE, name


def _onnx_dtype(name: str, array: np.ndarray, model) -> np.ndarray:
    # MNN takes Silero's int64 sample rate as int32; onnxruntime wants the original.
    return array.astype(np.int64) if name in model.input_ranges else array


def test_publisher_golden_inputs_are_stored_and_used(cp, tmp_path):
    model = by_name("ppocr-cls")
    inputs = model.golden_inputs(seed=3)
    with cp.client() as client:
        version = client.push(
            model.path, name="cls-golden", golden=_npz(tmp_path, inputs), variants=("fp16",)
        )
    assert version.golden.source == "publisher"
    _, data = cp.registry.golden("cls-golden", version.version)
    golden = Golden.from_npz(data)
    np.testing.assert_array_equal(golden.inputs["x"], inputs["x"])
    (theirs,) = _onnxruntime(model, inputs)
    assert _cosine(next(iter(golden.outputs.values())), theirs) >= FP32_COSINE
    fp16 = version.variants[1]
    assert fp16.name == "fp16" and not fp16.degraded
    assert fp16.accuracy.cosine >= 0.99
    assert [o.name for o in fp16.accuracy.outputs] == [t.name for t in version.signature.outputs]


def test_int8_detector_is_refused_with_its_figures(cp, tmp_path):
    """PP-OCRv4's detector loses its text map under int8 weight quantisation."""
    model = by_name("ppocr-det")
    golden = _npz(tmp_path, model.golden_inputs())
    with cp.client() as client, pytest.raises(errors.InvalidArgument) as refused:
        client.push(model.path, name="det-int8", golden=golden, variants=("int8",))
    message = str(refused.value)
    assert message.startswith("int8 degraded: cosine 0.") and "--allow-degraded" in message
    assert "below 0.99" in message and "nothing stored" in message
    with pytest.raises(errors.NotFound):
        cp.registry.show("det-int8")
    # Nothing of the refused push stays behind.
    referenced = cp.registry.store.referenced_blobs()
    assert set(cp.registry.blobs.keys()) == referenced


def test_int8_detector_kept_degraded_when_allowed(cp, tmp_path):
    model = by_name("ppocr-det")
    golden = _npz(tmp_path, model.golden_inputs())
    with cp.client() as client:
        version = client.push(
            model.path,
            name="det-degraded",
            golden=golden,
            variants=("int8", "fp16"),
            allow_degraded=True,
        )
    variants = {v.name: v for v in version.variants}
    assert variants["int8"].degraded
    assert variants["int8"].accuracy.cosine < 0.99 == variants["int8"].accuracy.min_cosine
    assert not variants["fp16"].degraded and variants["fp16"].accuracy.cosine >= 0.99
    assert not variants["fp32"].HasField("accuracy")
    # The signed manifest says so too, so a device can tell without trusting the server.
    import json

    manifest = json.loads(version.manifest)
    assert manifest["variants"]["int8"]["degraded"] is True
    assert manifest["golden"]["ciphertext_sha256"] == version.golden.ciphertext_sha256


def test_dynamic_inputs_without_shapes_are_refused_naming_the_input(cp):
    model = by_name("ppocr-rec")
    with cp.client() as client, pytest.raises(errors.InvalidArgument) as refused:
        client.push(model.path, name="rec-noshape")
    assert "input 'x' has dynamic shape [1, 3, ?, ?]" in str(refused.value)
    assert "--input-shape x=1,3,N,N" in str(refused.value)


def test_integer_input_without_range_names_golden_and_range(cp):
    model = by_name("silero-vad")
    with cp.client() as client, pytest.raises(errors.InvalidArgument) as refused:
        client.push(model.path, name="vad-norange", input_shapes=model.input_shapes)
    message = str(refused.value)
    assert "input 'sr' is int32" in message
    assert "--golden" in message and "--input-range sr=LOW:HIGH" in message


def test_a_device_holds_each_variant_to_what_the_registry_measured(cp, tmp_path):
    """The stored golden data loads the degraded int8 detector only at its own bar."""
    from runtime import Model
    from runtime.errors import ModelFailed

    model = by_name("ppocr-det")
    with cp.client() as client:
        client.push(
            model.path,
            name="det-selftest",
            golden=_npz(tmp_path, model.golden_inputs()),
            variants=("int8",),
            allow_degraded=True,
        )
    _, _, chunks = cp.registry.pull("det-selftest", 1, "int8")
    int8 = b"".join(chunks)
    _, data = cp.registry.golden("det-selftest", 1)
    golden = Golden.from_npz(data)
    variant = golden.for_variant("int8")
    assert 0.3 < variant.tolerance.min_cosine < 0.99 < golden.tolerance.min_cosine
    with pytest.raises(ModelFailed, match="no candidate config passed the probe"):
        Model.from_bytes(int8, golden=golden)  # fp32's own bar: int8 cannot reach it
    with Model.from_bytes(int8, golden=variant) as model:
        outputs = model.run(dict(golden.inputs))
    assert golden.for_variant("int8").compare(outputs).accepted
