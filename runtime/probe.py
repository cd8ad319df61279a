"""Probe backend configs on this device: does each really run there, correctly, and how fast.

For each candidate the probe loads the model with that config (refusing configs MNN
would silently run on another backend), runs the golden inputs a few times, compares
the outputs with the golden references, and times the runs. The result of each probe
is a `ProbeResult`, plain data ready for telemetry; `rank` orders the accepted ones,
fastest first. Without golden data the probe runs zeros of the exported input shapes
and only times them: zeros may rightly give non-finite outputs (log, division), so
nothing about the outputs is judged, and the caller probes no low-precision configs.

Zeros are not always possible or safe. A dynamic dim (exported as -1, as in PP-OCR's
[1, 3, -1, -1]) has no size to make zeros of unless the caller gives one
(``input_shapes``), and an integer input may be a sample rate or an index whose zero
crashes the engine (Silero VAD with sample rate 0 is a SIGSEGV in MNN). Then the config is
only loaded, not timed: accepted, with `ProbeResult.untimed` saying why, and candidates
keep their order of preference (safest first).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from runtime.backends import Backend, BackendConfig
from runtime.errors import (
    BackendUnavailable,
    InferenceError,
    InvalidInput,
    ModelLoadError,
)
from runtime.golden import Golden
from runtime.signature import Signature

__all__ = ["Executor", "ProbeResult", "measure", "probe_config", "rank", "synthetic_inputs"]

SAME_SPEED = 0.05  # p50s within 5% of the fastest are within a probe's timing noise
_ZERO_SAFE = ("float32", "float64")  # dtypes whose zeros are a harmless probe input


class Executor(Protocol):
    """What runs a model with one config: in this process or in a worker."""

    config: BackendConfig
    actual_backend: Backend
    evidence: str
    signature: Signature
    load_ms: float

    def run(self, arrays: Sequence[np.ndarray], exact: bool) -> dict[str, np.ndarray]:
        """Run validated inputs; return outputs by name."""

    def restart(self) -> None:
        """Replace a crashed worker (no-op in process: a crash there ends everything)."""

    def close(self) -> None:
        """Release the model (and the worker, if any)."""


@dataclass(frozen=True)
class ProbeResult:
    """How one config did on this device.

    `actual_backend` is where MNN really ran it (None if it never loaded); `accepted`
    says it may serve; `error` says why not. Latencies are per inference, in µs.
    """

    config: BackendConfig
    actual_backend: Backend | None
    accepted: bool
    p50_us: float | None = None
    p95_us: float | None = None
    p99_us: float | None = None
    samples_us: tuple[float, ...] = ()
    cosine: float | None = None
    max_abs_error: float | None = None
    load_ms: float | None = None
    error: str | None = None
    untimed: str | None = None  # why latency was not measured (the config still loaded)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict for telemetry."""
        return {
            "config": self.config.key,
            "actual_backend": self.actual_backend.name if self.actual_backend else None,
            "accepted": self.accepted,
            "p50_us": self.p50_us,
            "p95_us": self.p95_us,
            "p99_us": self.p99_us,
            "samples_us": list(self.samples_us),
            "cosine": self.cosine,
            "max_abs_error": _finite_or_none(self.max_abs_error),
            "load_ms": self.load_ms,
            "error": self.error,
            "untimed": self.untimed,
        }


def probe_config(
    make: Callable[[BackendConfig], Executor],
    config: BackendConfig,
    golden: Golden | None,
    *,
    runs: int = 10,
    warmup: int = 2,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> tuple[ProbeResult, Executor | None]:
    """Probe one config; return its result and, if accepted, the loaded executor.

    `input_shapes` gives sizes for dynamic dims when there is no golden data; an input it
    names that the model lacks, or of another rank, raises InvalidInput.
    """
    try:
        executor = make(config)
    except BackendUnavailable as exc:
        actual = exc.actual if isinstance(exc.actual, Backend) else None
        return ProbeResult(config, actual, False, error=str(exc)), None
    except (ModelLoadError, InferenceError) as exc:  # InferenceError: worker died loading
        return ProbeResult(config, None, False, error=f"load failed: {exc}"), None
    try:
        result = measure(executor, golden, runs=runs, warmup=warmup, input_shapes=input_shapes)
    except BaseException:
        executor.close()  # e.g. interrupted: a worker must not outlive the probe
        raise
    if not result.accepted:
        executor.close()
        return result, None
    return result, executor


def measure(
    executor: Executor,
    golden: Golden | None,
    *,
    runs: int = 10,
    warmup: int = 2,
    input_shapes: Mapping[str, tuple[int, ...]] | None = None,
) -> ProbeResult:
    """Time and judge an executor already loaded, as `probe_config` does a fresh one.

    Used for a config that serves already: its figures then compare with fresh probes'.
    """
    inputs = golden.inputs if golden else synthetic_inputs(executor.signature, input_shapes)
    if isinstance(inputs, str):
        actual, load_ms = executor.actual_backend, executor.load_ms
        return ProbeResult(executor.config, actual, True, load_ms=load_ms, untimed=inputs)
    return _measure(executor, inputs, golden, runs=max(1, runs), warmup=max(0, warmup))


def rank(results: Sequence[ProbeResult], *, margin: float = SAME_SPEED) -> list[ProbeResult]:
    """Return the accepted results, fastest (median latency) first.

    Results within `margin` of the fastest count as equally fast and keep their order
    (candidates are listed safest first), so timing noise alone never picks low
    precision or more threads over the plain config.
    """
    accepted = [(i, r) for i, r in enumerate(results) if r.accepted]
    if not accepted:
        return []
    p50 = {i: math.inf if r.p50_us is None else r.p50_us for i, r in accepted}
    fast = min(p50.values()) * (1 + margin)
    return [r for i, r in sorted(accepted, key=lambda ir: (max(p50[ir[0]], fast), ir[0]))]


def synthetic_inputs(
    signature: Signature, input_shapes: Mapping[str, tuple[int, ...]] | None
) -> dict[str, np.ndarray] | str:
    """Return zeros to time a model without golden data, or why there can be none.

    Shapes are `input_shapes` where given, else the exported ones. Raises InvalidInput for
    a hint that names no input of the model or has another rank.
    """
    shapes = dict(input_shapes or {})
    specs = {spec.name: spec for spec in signature.inputs}
    for name, shape in shapes.items():
        if name not in specs:
            raise InvalidInput(
                f"input_shapes names {name!r}, which the model does not take; "
                f"it takes {list(specs)}"
            )
        if len(shape) != len(specs[name].shape):
            raise InvalidInput(
                f"input_shapes gives {name!r} the shape {tuple(shape)}; the model takes "
                f"rank {len(specs[name].shape)}: {specs[name].shape}"
            )
    zeros = {}
    for spec in signature.inputs:
        shape = tuple(shapes.get(spec.name, spec.shape))
        if spec.dtype not in _ZERO_SAFE:
            return (
                f"not timed: integer input {spec.name!r} needs golden data (zeros may be "
                "outside its domain, e.g. a sample rate, and crash the engine)"
            )
        if any(n < 0 for n in shape):
            return (
                f"not timed: input {spec.name!r} has dynamic dims {spec.shape}; pass "
                "input_shapes or golden data to time the candidates"
            )
        zeros[spec.name] = np.zeros(shape, spec.dtype)
    return zeros


def _measure(
    executor: Executor,
    inputs: Mapping[str, np.ndarray],
    golden: Golden | None,
    *,
    runs: int,
    warmup: int,
) -> ProbeResult:
    """Time `runs` inferences of `inputs` and judge the outputs against `golden`, if any."""
    config, actual = executor.config, executor.actual_backend
    base = {"load_ms": executor.load_ms}
    try:
        arrays, exact = executor.signature.check(inputs)
        first = executor.run(arrays, exact)
        for _ in range(warmup):
            executor.run(arrays, exact)
        samples, last = [], first
        for _ in range(runs):
            start = time.perf_counter_ns()
            last = executor.run(arrays, exact)
            samples.append((time.perf_counter_ns() - start) / 1000)
    except InvalidInput as exc:
        return ProbeResult(config, actual, False, error=f"golden inputs do not fit: {exc}", **base)
    except InferenceError as exc:
        return ProbeResult(config, actual, False, error=f"inference failed: {exc}", **base)
    timing = _percentiles(samples)
    if golden is None:
        return ProbeResult(config, actual, True, **timing, **base)
    # Cold (first) and warm (last) outputs must both match: some backends tune on run 1.
    checks = [golden.compare(first), golden.compare(last)]
    worst = min(checks, key=lambda acc: (acc.accepted, acc.cosine))
    error = None if worst.accepted else f"rejected: {worst.problem}"
    return ProbeResult(
        config,
        actual,
        worst.accepted,
        **timing,
        cosine=worst.cosine,
        max_abs_error=max(acc.max_abs_error for acc in checks),
        error=error,
        **base,
    )


def _percentiles(samples: list[float]) -> dict[str, Any]:
    """Nearest-rank p50/p95/p99 of the samples, plus the samples themselves."""
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    percentiles = {"p50_us": at(0.5), "p95_us": at(0.95), "p99_us": at(0.99)}
    return {**percentiles, "samples_us": tuple(samples)}


def _finite_or_none(value: float | None) -> float | None:
    """JSON has no infinity: report a non-finite error as None (the error field says why)."""
    return value if value is not None and math.isfinite(value) else None
