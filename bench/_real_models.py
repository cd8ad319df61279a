"""Real third-party models (PP-OCRv4, Silero VAD) through the runtime, next to onnxruntime.

Used by `bench/infer.py`. Each model is converted with MNN's converter, loaded by
`runtime.Model` (in process, the bench's config) and by onnxruntime (same thread
count), and both run the model's realistic golden inputs: interleaved in rounds, in
shuffled order, each figure the median over rounds of per-round medians, the ratio taken
per round. The outputs are checked first (cosine similarity with onnxruntime's), so the
timings compare the same work.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import numpy as np

from control_plane.demo import sample_models
from control_plane.demo.third_party_models import THIRD_PARTY_MODELS, ThirdPartyModel
from runtime.backends import BackendConfig
from runtime.model import Model

MIN_COSINE = 0.998


def measure_all(config: BackendConfig, *, rounds: int, budget_s: float) -> dict[str, dict]:
    """Return the figures of every real model, by name."""
    options = {"rounds": rounds, "budget_s": budget_s}
    return {m.name: measure(m, config, **options) for m in THIRD_PARTY_MODELS}


def measure(model: ThirdPartyModel, config: BackendConfig, *, rounds: int, budget_s: float) -> dict:
    """Time one model through the runtime and onnxruntime on the same inputs."""
    import onnxruntime as ort

    data = sample_models.onnx_to_mnn_bytes(model.path.read_bytes())
    inputs = model.golden_inputs()
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = config.threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(str(model.path), options, providers=["CPUExecutionProvider"])
    with Model.from_bytes(data, config=config) as mnn:
        variants: dict[str, Callable[[], object]] = {
            "mnn": lambda: mnn.run(inputs),
            "onnxruntime": lambda: session.run(None, inputs),
        }
        cosine = _cosine(mnn.run(inputs), session.run(None, inputs))
        if cosine < MIN_COSINE:
            raise SystemExit(f"{model.name}: runtime and onnxruntime disagree (cosine {cosine})")
        medians = _interleaved(variants, rounds, budget_s)
    ratios = [a / b for a, b in zip(medians["mnn"], medians["onnxruntime"], strict=True)]
    return {
        "mnn_p50_us": round(statistics.median(medians["mnn"]), 1),
        "onnxruntime_p50_us": round(statistics.median(medians["onnxruntime"]), 1),
        "ratio_vs_onnxruntime": round(statistics.median(ratios), 3),
        "cosine": round(cosine, 6),
        "model_bytes": len(data),
        "input_shapes": {k: list(v.shape) for k, v in inputs.items()},
    }


def _interleaved(variants: dict, rounds: int, budget_s: float) -> dict[str, list[float]]:
    """Per-round median µs of each variant, rounds interleaved in shuffled order."""
    for fn in variants.values():  # warm up: first runs allocate and tune
        for _ in range(3):
            fn()
    per_call = max(time_block(fn, 3) for fn in variants.values()) / 1e6
    iters = max(3, int(budget_s / rounds / len(variants) / per_call))
    medians: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for _ in range(rounds):
        random.shuffle(order)
        for key in order:
            medians[key].append(time_block(variants[key], iters))
    return medians


def time_block(fn: Callable[[], object], iters: int) -> float:
    """Median per-call latency of `iters` calls, in µs."""
    samples = []
    for _ in range(iters):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return statistics.median(samples) / 1000


def _cosine(outputs: dict[str, np.ndarray], reference: list[np.ndarray]) -> float:
    """Worst cosine similarity over the outputs (same order as onnxruntime's)."""
    worst = 1.0
    for got, want in zip(outputs.values(), reference, strict=True):
        a, b = got.astype(np.float64).ravel(), np.asarray(want, np.float64).ravel()
        worst = min(worst, float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return worst
