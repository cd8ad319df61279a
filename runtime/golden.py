"""Golden inputs shipped with a model: named inputs, reference outputs and a tolerance.

The probe runs the golden inputs on every candidate config and accepts a config only if
its outputs match the references. The format is one ``.npz`` (numpy's zip of ``.npy``
files, read without pickle): ``input/<name>`` and ``output/<name>`` arrays plus a
``meta`` entry holding the tolerance as UTF-8 JSON. The control plane ships it next to
the model; `Golden.make` builds one from the reference config (fp32 CPU, one thread).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from runtime.npz import read_npz, write_npz
from runtime.signature import SUPPORTED_DTYPES

__all__ = ["Accuracy", "Golden", "OutputError", "Tolerance", "output_errors"]

FORMAT = "skiff-golden/1"
_INPUT, _OUTPUT, _META = "input/", "output/", "meta"
_MAX_META_BYTES = 1 << 20  # tolerances as JSON: a few hundred bytes per variant
MAX_GOLDEN_BYTES = 256 << 20  # uncompressed; golden inputs are a handful of samples


@dataclass(frozen=True)
class Tolerance:
    """How close a config's outputs must be to the references to be accepted.

    Cosine similarity is scale-free and catches wrong directions (fp16 overflow, bad
    kernels); the absolute bound, when set, catches small-but-wrong magnitudes for
    models whose output scale the publisher knows. None means not checked.
    """

    min_cosine: float = 0.999
    max_abs_error: float | None = None

    def __post_init__(self) -> None:
        # NaN compares false with everything: a NaN bar would accept any output.
        if not -1.0 <= self.min_cosine <= 1.0:
            raise ValueError(f"min_cosine must be in [-1, 1], not {self.min_cosine}")
        bound = self.max_abs_error
        if bound is not None and not 0.0 <= bound < math.inf:
            raise ValueError(f"max_abs_error must be finite and >= 0, not {bound}")

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict."""
        return {"min_cosine": self.min_cosine, "max_abs_error": self.max_abs_error}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Tolerance:
        """Rebuild from `to_dict` output."""
        bound = d.get("max_abs_error")
        return cls(float(d.get("min_cosine", 0.999)), None if bound is None else float(bound))


@dataclass(frozen=True)
class Accuracy:
    """How one run's outputs compare with the references (worst over all outputs)."""

    cosine: float
    max_abs_error: float
    finite: bool
    problem: str | None  # why it fails the tolerance, or None if it passes

    @property
    def accepted(self) -> bool:
        """Tell whether the outputs are within the tolerance."""
        return self.problem is None


@dataclass(frozen=True, eq=False)
class Golden:
    """Named golden inputs, the reference outputs they must give, and the tolerance."""

    inputs: Mapping[str, np.ndarray]
    outputs: Mapping[str, np.ndarray]
    tolerance: Tolerance = field(default_factory=Tolerance)
    # What each derived variant (int8, fp16...) of the model is held to against these fp32
    # outputs: the figures the registry measured for it, so a device can check it gets
    # what the publisher accepted. `tolerance` is for the model these outputs came from.
    variant_tolerances: Mapping[str, Tolerance] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for kind, arrays in (("input", self.inputs), ("output", self.outputs)):
            if not arrays:
                raise ValueError(f"golden data needs at least one {kind}")
            for name, array in arrays.items():
                if not isinstance(array, np.ndarray) or array.dtype.name not in SUPPORTED_DTYPES:
                    raise ValueError(f"golden {kind} {name!r} must be a numeric numpy array")
        for name, array in self.outputs.items():
            if not np.isfinite(array).all():
                raise ValueError(f"golden output {name!r} is not finite: pick other inputs")

    def compare(self, outputs: Mapping[str, np.ndarray]) -> Accuracy:
        """Compare a run's outputs with the references, output by output."""
        cosine, max_abs, finite, problem = 1.0, 0.0, True, None
        for name, reference in self.outputs.items():
            got = outputs.get(name)
            if got is None or got.shape != reference.shape:
                shape = None if got is None else got.shape
                problem = f"output {name!r} has shape {shape}, expected {reference.shape}"
                return Accuracy(0.0, math.inf, True, problem)
            a, b = got.astype(np.float64).ravel(), reference.astype(np.float64).ravel()
            if not np.isfinite(a).all():
                finite, problem = False, problem or f"output {name!r} is not finite"
                cosine, max_abs = 0.0, math.inf
                continue
            cosine = min(cosine, _cosine(a, b))
            max_abs = max(max_abs, float(np.max(np.abs(a - b))) if a.size else 0.0)
        tol = self.tolerance
        if problem is None and cosine < tol.min_cosine:
            problem = f"cosine similarity {cosine:.6f} < {tol.min_cosine}"
        if problem is None and tol.max_abs_error is not None and max_abs > tol.max_abs_error:
            problem = f"max abs error {max_abs:.3g} > {tol.max_abs_error}"
        return Accuracy(cosine, max_abs, finite, problem)

    def for_variant(self, variant: str) -> Golden:
        """Return this golden data holding `variant` to its own tolerance, if it has one."""
        tolerance = self.variant_tolerances.get(variant, self.tolerance)
        return Golden(self.inputs, self.outputs, tolerance, self.variant_tolerances)

    def to_npz(self) -> bytes:
        """Serialise to the ``.npz`` format described in the module docstring."""
        arrays = {_INPUT + k: v for k, v in self.inputs.items()}
        arrays |= {_OUTPUT + k: v for k, v in self.outputs.items()}
        meta = {
            "format": FORMAT,
            "tolerance": self.tolerance.to_dict(),
            "variants": {k: v.to_dict() for k, v in self.variant_tolerances.items()},
        }
        arrays[_META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        return write_npz(arrays, compress=True)

    @classmethod
    def from_npz(cls, data: bytes) -> Golden:
        """Parse `to_npz` output; ValueError names what is wrong. Never unpickles."""
        arrays = read_npz(data, "golden data", MAX_GOLDEN_BYTES)
        tolerance, variants = _tolerances(arrays.pop(_META, np.zeros(0, np.uint8)))
        inputs = {k[len(_INPUT) :]: v for k, v in arrays.items() if k.startswith(_INPUT)}
        outputs = {k[len(_OUTPUT) :]: v for k, v in arrays.items() if k.startswith(_OUTPUT)}
        return cls(inputs, outputs, tolerance, variants)

    @classmethod
    def make(
        cls,
        model: bytes,
        inputs: Mapping[str, np.ndarray],
        *,
        tolerance: Tolerance | None = None,
        isolated: bool = True,
    ) -> Golden:
        """Run `inputs` through `model` with the reference config and record the outputs.

        With `isolated` (the default) MNN runs in a throwaway worker process, so a model
        that crashes MNN cannot take the caller (e.g. the control plane) down with it.
        """
        from runtime.backends import REFERENCE_CONFIG
        from runtime.model import Isolation, Model  # late: model imports this module

        isolation = Isolation.WORKER if isolated else Isolation.IN_PROCESS
        # Non-finite references are refused below, with a clearer message than a fallback.
        options = {"config": REFERENCE_CONFIG, "isolation": isolation, "check_finite": False}
        with Model.from_bytes(model, **options) as m:
            if m.config != REFERENCE_CONFIG:
                raise ValueError(f"the reference config {REFERENCE_CONFIG.key} cannot run it")
            outputs = m.run(dict(inputs))
        return cls(dict(inputs), outputs, tolerance or Tolerance())


class OutputError(NamedTuple):
    """How one output compares with its reference.

    Cosine similarity is blind to scale (an output 15x too small scores 1.0); the relative
    error ``|got - ref| / |ref|`` (L2 norms) is not.
    """

    cosine: float
    max_abs_error: float
    relative_error: float


def output_errors(
    reference: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]
) -> dict[str, OutputError]:
    """Return how each output of `reference` compares with the same output in `outputs`.

    A missing, reshaped or non-finite output scores (0.0, inf, inf).
    """
    found = {}
    for name, ref in reference.items():
        got = outputs.get(name)
        if got is None or got.shape != ref.shape or not np.isfinite(got).all():
            found[name] = OutputError(0.0, math.inf, math.inf)
            continue
        a, b = got.astype(np.float64).ravel(), ref.astype(np.float64).ravel()
        max_abs = float(np.max(np.abs(a - b))) if a.size else 0.0
        found[name] = OutputError(_cosine(a, b), max_abs, _relative(a, b))
    return found


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    """Return |a - b| / |b| (L2); 0 for two all-zero vectors, inf against a zero reference."""
    diff, norm = float(np.linalg.norm(a - b)), float(np.linalg.norm(b))
    if norm == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / norm


def _tolerances(meta: np.ndarray) -> tuple[Tolerance, dict[str, Tolerance]]:
    """Read the tolerances from the ``meta`` entry; ValueError for anything malformed."""
    if meta.nbytes > _MAX_META_BYTES:
        raise ValueError(
            f"golden data has meta of {meta.nbytes:,} bytes (limit {_MAX_META_BYTES:,})"
        )
    try:
        parsed = json.loads(meta.tobytes().decode() or "{}")
        found = parsed.get("format")
        if found != FORMAT:
            raise ValueError(f"golden data format is {found!r}, not {FORMAT!r}")
        variants = {str(k): Tolerance.from_dict(v) for k, v in parsed.get("variants", {}).items()}
        return Tolerance.from_dict(parsed.get("tolerance", {})), variants
    # JSON of the wrong shape, numbers too large for a float, nesting too deep to parse.
    except (AttributeError, TypeError, OverflowError, RecursionError) as exc:
        raise ValueError(f"golden data has malformed meta: {type(exc).__name__}") from None


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two flat vectors; two all-zero vectors are identical."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(np.dot(a, b) / (na * nb))
