"""Per-inference latency through the runtime, next to bare MNN and onnxruntime, one run.

For each model (an 8 MB MLP, the main figure; a 2 MB one; and the tiny one, where the
runtime's fixed per-call cost shows most) this times, on the same config (CPU, normal
precision, 1 thread):

- bare MNN: ``Module.forward`` on a reused input Var, output read and copied (the copy is
  what correct use costs: MNN reuses the buffer behind ``Var.read()``);
- the runtime in process: ``Model.run`` (validation, finite check, histogram included);
- the runtime through its worker process (Unix socket round trip per request);
- onnxruntime on the same ONNX model, for reference.

For scale, `ipc_floor_us` is what any process isolation costs here: the round trip of
a 1-byte message to a bare Python process that busy-waits as long as bare MNN takes,
minus that time (it is mostly the two cross-process wake-ups).

Variants are interleaved in many short rounds, in shuffled order, each block after a
random shift of the heap (memory layout alone moves the tiny model by ~10 µs). Each
figure is the median over rounds of per-round medians; each ratio or difference is
taken per round against the bare MNN median of that same round, and the median of
those is reported (machines are noisy). The last line is one JSON object: the main
model's figures at the top level, every model's under "models".

Then the real third-party models (PP-OCRv4 detector, recogniser and classifier, Silero
VAD; see `bench/_real_models.py`): the runtime in process against onnxruntime on the
same realistic inputs, outputs checked equal (cosine), under "real_models" as
``{name: {mnn_p50_us, onnxruntime_p50_us, ratio_vs_onnxruntime, cosine}}``.

    python bench/infer.py            # more rounds
    python bench/infer.py --quick    # within a minute on 2 cores
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _real_models  # noqa: E402
from bench._real_models import time_block  # noqa: E402
from control_plane.demo import sample_models  # noqa: E402
from runtime import mnn_host  # noqa: E402
from runtime.backends import BackendConfig  # noqa: E402
from runtime.model import Isolation, Model  # noqa: E402

CONFIG = BackendConfig()  # CPU / normal precision / 1 thread / normal memory
MB = 1_000_000


def bare_mnn(module: object, x: np.ndarray) -> tuple[Callable[[], object], Callable[[], None]]:
    """The baseline: ``Module.forward`` called directly, used correctly.

    It drives the very module the in-process runtime loaded (same config, same weights
    in the same memory): two separately loaded copies of one model differ by several µs
    per call from memory layout alone, which would swamp the wrapper's cost.
    """
    expr = mnn_host.load_mnn().expr
    var = expr.placeholder(list(x.shape), expr.NCHW, expr.float)

    def run() -> object:
        var.write(x)
        return module.forward([var])[0].read().copy()

    return run, lambda: None


def runtime_model(data: bytes, x: np.ndarray, isolation: Isolation):
    """The runtime's `Model.run`; in process, also its MNN module (for the baseline)."""
    model = Model.from_bytes(data, config=CONFIG, isolation=isolation)
    inputs = {"x": x}
    module = getattr(model._chain.active, "_module", None)  # private: benchmark only
    return (lambda: model.run(inputs)), model.close, module


def onnxruntime(onnx_bytes: bytes, x: np.ndarray):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = CONFIG.threads
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    session = ort.InferenceSession(onnx_bytes, options, providers=["CPUExecutionProvider"])
    return (lambda: session.run(None, {"x": x})), (lambda: None)


_ECHO = """
import socket, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
work = int(float(sys.argv[2]) * 1000)
while data := sock.recv(64):
    end = time.perf_counter_ns() + work
    while time.perf_counter_ns() < end:
        pass
    sock.sendall(data)
"""


def ipc_floor(work_us: float, rounds: int, iters: int) -> float:
    """Median extra µs of a socket round trip to a process that works `work_us` per call."""
    parent, child = socket.socketpair()
    argv = [sys.executable, "-c", _ECHO, str(child.fileno()), str(work_us)]
    proc = subprocess.Popen(argv, pass_fds=(child.fileno(),))
    child.close()

    def call() -> None:
        parent.sendall(b"x")
        parent.recv(64)

    try:
        return statistics.median(time_block(call, iters) for _ in range(rounds)) - work_us
    finally:
        parent.close()
        proc.wait()


def measure(name: str, onnx_bytes: bytes, rounds: int, budget_s: float) -> dict:
    """Time every variant on one model, interleaved; return the figures."""
    data = sample_models.onnx_to_mnn_bytes(onnx_bytes)
    x = np.random.default_rng(0).standard_normal((1, _input_width(onnx_bytes)))
    x = x.astype(np.float32)
    in_process = runtime_model(data, x, Isolation.IN_PROCESS)
    variants = {
        "bare_mnn": bare_mnn(in_process[2], x),
        "runtime_in_process": in_process[:2],
        "runtime_worker": runtime_model(data, x, Isolation.WORKER)[:2],
        "onnxruntime": onnxruntime(onnx_bytes, x),
    }
    _check_same_answers(variants)
    per_call = max(time_block(fn, 50) for fn, _ in variants.values()) / 1e6
    iters = max(20, int(budget_s / rounds / len(variants) / per_call))
    medians: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for _ in range(rounds):
        random.shuffle(order)
        for key in order:
            gc.collect()
            # Shift the heap by a random amount. The same code ran the tiny model at ~17
            # or ~27 µs depending on what had been allocated before it, so a fixed layout
            # can favour one variant for good; a random one per block gives every variant
            # the same mix.
            shim = bytearray(random.randrange(64, 1 << 16))
            medians[key].append(time_block(variants[key][0], iters))
            del shim
    for _, close in variants.values():
        close()
    bare = medians["bare_mnn"]
    result = {k: round(statistics.median(v), 2) for k, v in medians.items()}
    result |= {
        "model": name,
        "model_bytes": len(data),
        "iters_per_round": iters,
        "overhead_in_process": round(_median_ratio(medians["runtime_in_process"], bare) - 1, 4),
        "overhead_in_process_us": round(_median_diff(medians["runtime_in_process"], bare), 2),
        "worker_overhead_us": round(_median_diff(medians["runtime_worker"], bare), 2),
        "worker_vs_in_process_us": round(
            _median_diff(medians["runtime_worker"], medians["runtime_in_process"]), 2
        ),
        "onnxruntime_vs_bare": round(_median_ratio(medians["onnxruntime"], bare), 3),
    }
    return result


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def _median_diff(a: list[float], b: list[float]) -> float:
    return statistics.median(x - y for x, y in zip(a, b, strict=True))


def _input_width(onnx_bytes: bytes) -> int:
    import onnx

    graph = onnx.load_from_string(onnx_bytes).graph
    return graph.input[0].type.tensor_type.shape.dim[1].dim_value


def _check_same_answers(variants: dict) -> None:
    """All four must compute the same function, or the timings compare nothing."""
    outs = {}
    for key, (fn, _) in variants.items():
        out = fn()
        outs[key] = out["y"] if isinstance(out, dict) else out[0] if isinstance(out, list) else out
    ref = outs["onnxruntime"]
    for key, out in outs.items():
        if not np.allclose(out, ref, rtol=1e-3, atol=1e-4):
            raise SystemExit(f"{key} disagrees with onnxruntime")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds, under a minute")
    parser.add_argument("--model-mb", type=float, default=8.0, help="main model weights, MB")
    args = parser.parse_args()
    rounds, budget = (31, 5.0) if args.quick else (101, 20.0)
    real_rounds, real_budget = (5, 2.0) if args.quick else (21, 10.0)
    command = shlex.join(["python", "bench/infer.py", *sys.argv[1:]])
    started = time.perf_counter()
    models = [
        (f"mlp-{args.model_mb:g}MB", sample_models.sized_mlp_onnx(int(args.model_mb * MB))),
        ("mlp-2MB", sample_models.sized_mlp_onnx(2 * MB)),
        ("tiny-mlp-16-32-4", sample_models.tiny_mlp_onnx()),
    ]
    all_figures = [measure(name, onnx_bytes, rounds, budget) for name, onnx_bytes in models]
    figures = all_figures[0]
    floor = ipc_floor(figures["bare_mnn"], 7, figures["iters_per_round"])
    figures["ipc_floor_us"] = round(floor, 2)
    print(f"config {CONFIG.key}; {rounds} interleaved rounds; medians in µs per inference")
    header = f"{'model':<18}{'bare MNN':>10}{'runtime':>10}{'worker':>10}{'onnxrt':>10}"
    print(header + f"{'overhead':>10}{'+µs':>8}{'worker +µs':>12}")
    for f in all_figures:
        print(
            f"{f['model']:<18}{f['bare_mnn']:>10.1f}{f['runtime_in_process']:>10.1f}"
            f"{f['runtime_worker']:>10.1f}{f['onnxruntime']:>10.1f}"
            f"{f['overhead_in_process']:>10.2%}{f['overhead_in_process_us']:>8.1f}"
            f"{f['worker_overhead_us']:>12.1f}"
        )
    print(
        f"process isolation floor here: {floor:.1f} µs per call (socket round trip to an idle "
        f"Python process doing the same {figures['bare_mnn']:.0f} µs of work)"
    )
    real = _real_models.measure_all(CONFIG, rounds=real_rounds, budget_s=real_budget)
    print(f"real models, {real_rounds} interleaved rounds; medians in µs per inference")
    print(f"{'model':<18}{'runtime':>12}{'onnxrt':>12}{'ratio':>8}{'cosine':>10}")
    for name, f in real.items():
        print(
            f"{name:<18}{f['mnn_p50_us']:>12.1f}{f['onnxruntime_p50_us']:>12.1f}"
            f"{f['ratio_vs_onnxruntime']:>8.2f}{f['cosine']:>10.6f}"
        )
    print(f"reproduce: {command}")
    summary = {
        "bench": "infer",
        "command": command,
        "config": CONFIG.key,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "mnn": mnn_host.load_mnn().version(),
        **figures,
        "models": all_figures,
        "real_models": real,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
