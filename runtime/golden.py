"""Golden inputs shipped with a model: named inputs, reference outputs and a tolerance.

The probe runs the golden inputs on every candidate config and accepts a config only if
its outputs match the references. The format is one ``.npz`` (numpy's zip of ``.npy``
files, read without pickle): ``input/<name>`` and ``output/<name>`` arrays plus a
``meta`` entry holding the tolerance as UTF-8 JSON. The control plane ships it next to
the model; `Golden.make` builds one from the reference config (fp32 CPU, one thread).
"""

from __future__ import annotations

import io
import json
import math
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.signature import SUPPORTED_DTYPES

__all__ = ["Accuracy", "Golden", "Tolerance"]

FORMAT = "skiff-golden/1"
_INPUT, _OUTPUT, _META = "input/", "output/", "meta"
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

    def to_npz(self) -> bytes:
        """Serialise to the ``.npz`` format described in the module docstring."""
        arrays = {_INPUT + k: v for k, v in self.inputs.items()}
        arrays |= {_OUTPUT + k: v for k, v in self.outputs.items()}
        meta = {"format": FORMAT, "tolerance": self.tolerance.to_dict()}
        arrays[_META] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **arrays)
        return buffer.getvalue()

    @classmethod
    def from_npz(cls, data: bytes) -> Golden:
        """Parse `to_npz` output; ValueError names what is wrong. Never unpickles."""
        try:
            archive = zipfile.ZipFile(io.BytesIO(data))
            if sum(info.file_size for info in archive.infolist()) > MAX_GOLDEN_BYTES:
                raise ValueError("golden data is larger than its limit")
            with np.load(io.BytesIO(data), allow_pickle=False) as npz:
                arrays = {name: npz[name] for name in npz.files}
        except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:  # Value: pickles
            raise ValueError(f"golden data is not a valid .npz: {exc}") from None
        tolerance = _tolerance(arrays.pop(_META, np.zeros(0, np.uint8)))
        inputs = {k[len(_INPUT) :]: v for k, v in arrays.items() if k.startswith(_INPUT)}
        outputs = {k[len(_OUTPUT) :]: v for k, v in arrays.items() if k.startswith(_OUTPUT)}
        return cls(inputs, outputs, tolerance)

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


def _tolerance(meta: np.ndarray) -> Tolerance:
    """Read the tolerance from the ``meta`` entry; ValueError for anything malformed."""
    try:
        parsed = json.loads(meta.tobytes().decode() or "{}")
        found = parsed.get("format")
        if found != FORMAT:
            raise ValueError(f"golden data format is {found!r}, not {FORMAT!r}")
        return Tolerance.from_dict(parsed.get("tolerance", {}))
    except (AttributeError, TypeError) as exc:  # JSON of the wrong shape
        raise ValueError(f"golden data has malformed meta: {exc}") from None


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    """Cosine similarity of two flat vectors; two all-zero vectors are identical."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return float(np.dot(a, b) / (na * nb))
