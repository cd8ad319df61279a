"""Run a push's golden inputs through every variant and judge the variants against fp32.

The fp32 model runs first, in one sandboxed MNN child that reads its declared inputs,
builds the golden inputs they need and runs them with the reference config; then every
other variant runs the same inputs in its own child. fp32's outputs become the version's golden
reference and its output signature (real shapes and dtypes from a real run); every other
variant is compared with them (`golden.accuracy`).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from control_plane.registry import golden, mnn_tools

__all__ = ["Evaluation", "evaluate"]


@dataclass(frozen=True)
class Evaluation:
    """What the golden run found: signatures, accuracy and degraded flags, golden data."""

    signatures: dict[str, dict[str, Any]]  # per variant
    accuracy: dict[str, dict[str, Any]]  # per derived variant ({} for fp32)
    degraded: dict[str, bool]
    golden: bytes  # runtime.golden's .npz: inputs and fp32's outputs


def evaluate(
    fds: Mapping[str, int],
    base: str,
    request: golden.GoldenRequest,
    *,
    pool: Executor,
    limits: Mapping[str, Any],
) -> Evaluation:
    """Run `fds[base]` on golden inputs built in its child, then every variant in `pool`."""
    recipe = json.dumps(
        {
            "input_shapes": {k: list(v) for k, v in request.input_shapes.items()},
            "input_ranges": {k: list(v) for k, v in request.input_ranges.items()},
        }
    )
    with contextlib.ExitStack() as stack:
        source = _memfd(stack, "skiff-golden-source", request.golden)
        base_run = mnn_tools.run_golden(
            fds[base],
            source,
            recipe=recipe,
            prefix="not a valid MNN model",  # the pushed model itself: what its errors say
            **limits,
        )
        assert base_run.inputs is not None
        inputs_fd = _memfd(stack, "skiff-golden-inputs", golden.npz_bytes(base_run.inputs))
        runs = {
            name: pool.submit(
                mnn_tools.run_golden,
                fd,
                inputs_fd,
                prefix=f"{name} variant could not run the golden inputs",
                **limits,
            )
            for name, fd in fds.items()
            if name != base
        }
        try:
            outputs = {base: base_run.outputs} | {n: r.result().outputs for n, r in runs.items()}
        finally:
            for run in runs.values():
                run.cancel()
            # A cancelled run never started; a running one still reads inputs_fd.
            for run in runs.values():
                if not run.cancelled():
                    run.exception()
    reference = outputs[base]
    bars = {
        name: golden.accuracy(name, reference, found, request)
        for name, found in outputs.items()
        if name != base
    }
    golden.refuse_degraded(bars, request)  # every variant judged first: one answer names all
    tolerances = {name: bar.self_test for name, bar in bars.items()}
    stored = golden.reference_golden(base_run.inputs, reference, tolerances)
    base_signature = {
        "inputs": [
            {"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in base_run.input_specs
        ],
        "mnn_version": base_run.mnn_version,
    }
    return Evaluation(
        signatures={
            name: {**base_signature, "outputs": _output_specs(found)}
            for name, found in outputs.items()
        },
        accuracy={name: bar.figures for name, bar in bars.items()},
        degraded={name: bar.degraded for name, bar in bars.items()},
        golden=stored,
    )


def _memfd(stack: contextlib.ExitStack, name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    stack.callback(os.close, fd)
    os.write(fd, data)
    return fd


def _output_specs(outputs: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
    return [
        {"name": name, "shape": list(array.shape), "dtype": array.dtype.name}
        for name, array in outputs.items()
    ]
