"""`skiff demo --real-models`: third-party models from PyPI packages, published honestly.

PP-OCRv4's text detector, recogniser and direction classifier and Silero VAD are pushed
the way a publisher would (ONNX, dynamic shapes declared with --input-shape, Silero's
sample rate with --input-range); the registry runs golden inputs through every variant.
The detector's int8 variant is refused with its figures, then kept marked degraded when
the publisher insists. Each model's fp32 variant and golden data are then pulled into
memory, loaded by the runtime (probed with the golden data) and compared with
onnxruntime on the same inputs.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np

from contract import errors
from contract.pinned_keys import PinnedKeyRing
from control_plane.api.client import AdminClient
from control_plane.api.trust import verify_version
from control_plane.demo.third_party_models import THIRD_PARTY_MODELS, ThirdPartyModel, by_name
from control_plane.views import registry_text as views
from runtime import Model
from runtime.golden import Golden

__all__ = ["run_real_models_demo"]


def run_real_models_demo(
    client: AdminClient, pins: PinnedKeyRing, work: Path, say: Callable[[str], None]
) -> None:
    """Push, judge, pull and run every third-party model; print what happens.

    The OCR models get golden inputs as a publisher would give them (a page of text-like
    strokes, in `work`): on random inputs the detector's text map is all but empty, and
    comparing variants on it says little. Silero VAD gets seeded inputs from its shapes
    and its sample rate's range.
    """
    say("\n== real third-party models (PP-OCRv4, Silero VAD) from their PyPI packages")
    det = by_name("ppocr-det")
    say(f"\n== push {det.name} with an int8 variant and golden inputs (a synthetic page)")
    try:
        _push(client, det, work, variants=("int8", "fp16"))
    except errors.InvalidArgument as exc:
        say(f"   refused: {exc}")
    say(f"\n== push {det.name} again with --allow-degraded")
    say(_shown(pins, _push(client, det, work, variants=("int8", "fp16"), allow_degraded=True)))
    for model in THIRD_PARTY_MODELS[1:]:
        say(f"\n== push {model.name}")
        say(_shown(pins, _push(client, model, work, variants=("fp16",))))
    say("\n== pull each fp32 model and its golden data into memory, run them with the runtime")
    for model in THIRD_PARTY_MODELS:
        say(_run(client, pins, model))


def _shown(pins: PinnedKeyRing, version) -> str:
    signed_by = verify_version(pins, version, model=version.model, number=version.version).key_id
    return views.version_text(version, signed_by=signed_by)


def _push(client: AdminClient, model: ThirdPartyModel, work: Path, **options):
    golden = None
    if not model.input_ranges:  # the OCR models: realistic inputs from the publisher
        golden = work / f"{model.name}-golden.npz"
        buffer = io.BytesIO()
        np.savez(buffer, **model.golden_inputs())
        golden.write_bytes(buffer.getvalue())
    return client.push(
        model.path,
        name=model.name,
        notes=f"{model.distribution}: {model.file.rsplit('/', 1)[-1]}",
        golden=golden,
        input_shapes=model.input_shapes if golden is None else None,
        input_ranges=model.input_ranges,
        **options,
    )


def _run(client: AdminClient, pins: PinnedKeyRing, model: ThirdPartyModel) -> str:
    _, mnn = client.pull_bytes(model.name, None, pins=pins)
    _, data = client.pull_bytes(model.name, None, pins=pins, golden=True)
    golden = Golden.from_npz(data)
    with Model.from_bytes(mnn, golden=data) as loaded:
        outputs = loaded.run(dict(golden.inputs))
        config = loaded.config.key
    line = f"   {model.name:<16} runs on {config}"
    reference = _onnxruntime(model, golden.inputs)
    if reference is None:
        return line + " (onnxruntime not installed: no comparison)"
    worst = min(_cosine(outputs[name], theirs) for name, theirs in reference.items())
    return line + f", cosine with onnxruntime {worst:.6f}"


def _onnxruntime(model: ThirdPartyModel, inputs) -> dict[str, np.ndarray] | None:
    try:
        import onnxruntime
    except ImportError:
        return None
    session = onnxruntime.InferenceSession(str(model.path), providers=["CPUExecutionProvider"])
    feeds = {}
    for spec in session.get_inputs():
        array = inputs[spec.name]
        # MNN takes int64 inputs (Silero's sample rate) as int32; onnxruntime wants int64.
        feeds[spec.name] = array.astype(np.int64) if spec.type == "tensor(int64)" else array
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
