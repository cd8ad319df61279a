"""Golden data and accuracy gates at push.

Every version carries golden data: inputs, and the outputs MNN's reference config gives
for them with the fp32 model. The inputs are the publisher's (``--golden``, an ``.npz``
of arrays named after the model's inputs) or, failing that, seeded random values built
from the signature: dynamic dimensions come from ``--input-shape``, integer inputs (a
sample rate, token ids) from ``--input-range``, because no default would be honest for
them. Each derived variant runs the same inputs and is compared with fp32 output by
output; one that misses a bar (the cosine, or the relative error it allows) is refused
with the figures of every variant, or kept marked degraded when the publisher says so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from contract import errors
from control_plane.registry import accuracy_bars
from control_plane.registry.contract import DEFAULT_MIN_COSINE, MAX_GOLDEN_UPLOAD
from control_plane.registry.golden_request import MAX_HINTS, GoldenRequest
from control_plane.registry.mnn_tools import TensorSpec
from runtime.golden import MAX_GOLDEN_BYTES, Golden, Tolerance, output_errors
from runtime.npz import read_npz, write_npz

__all__ = [
    "AccuracyBar",
    "GoldenRequest",
    "DEFAULT_MIN_COSINE",
    "MAX_GOLDEN_UPLOAD",
    "MAX_HINTS",
    "accuracy",
    "golden_inputs",
    "reference_golden",
    "refuse_degraded",
]

# All golden inputs together, in the model's dtypes: what the server holds (a few times
# over) while a push runs, and what every device receives.
MAX_GOLDEN_INPUT_BYTES = 64 << 20
# How far a device's run of a variant may fall below what the registry measured for it
# (other backends, other kernels) before its self-test fails.
SELF_TEST_SLACK = 0.005
SEED = 0  # seeded inputs are reproducible: the same model and flags give the same data
_FLOAT_DTYPES = ("float16", "float32", "float64")
_INT_DTYPES = ("int8", "uint8", "int16", "int32", "int64")


@dataclass(frozen=True)
class AccuracyBar:
    """The outcome of comparing one variant with fp32: figures, and whether it missed a bar.

    `self_test` is what a device holds the variant to against fp32's golden outputs: the
    figures measured here, less a little slack for other backends.
    """

    figures: dict[str, Any]
    degraded: bool
    self_test: Tolerance
    variant: str = ""


def golden_inputs(inputs: Sequence[TensorSpec], request: GoldenRequest) -> dict[str, np.ndarray]:
    """Return the golden inputs for a model with `inputs`, in the model's dtypes.

    InvalidArgument says which input is missing, unknown, mis-shaped or needs a shape or
    a range.
    """
    request.check()
    unknown = _unknown_hints(inputs, request)
    if request.golden:
        if unknown:
            raise errors.InvalidArgument(unknown)
        return _publisher_inputs(inputs, request)
    # Every problem at once: a model with three inputs must not take three rounds.
    problems, flags = [unknown] if unknown else [], []
    shapes = {spec.name: _seeded_shape(spec, request, problems, flags) for spec in inputs}
    bounds = {spec.name: _seeded_bounds(spec, request, problems, flags) for spec in inputs}
    if problems:  # what to pass first: it is what a publisher acts on
        need = f"need {' '.join(flags)} (or golden inputs with --golden INPUTS.npz)"
        raise errors.InvalidArgument(
            f"seeded golden inputs {need if flags else 'cannot be built'}: {'; '.join(problems)}"
        )
    _check_total({spec.name: (shapes[spec.name], spec.dtype) for spec in inputs}, "seeded")
    rng = np.random.default_rng(SEED)
    return {spec.name: _seeded(spec, shapes[spec.name], bounds[spec.name], rng) for spec in inputs}


def _check_total(arrays: Mapping[str, tuple[tuple[int, ...], str]], kind: str) -> None:
    """Refuse golden inputs that would take more than MAX_GOLDEN_INPUT_BYTES in all."""
    total = 0
    for shape, dtype in arrays.values():
        size = np.dtype(dtype).itemsize if dtype in _FLOAT_DTYPES + _INT_DTYPES else 8
        total += math.prod(shape) * size
    if total > MAX_GOLDEN_INPUT_BYTES:
        raise errors.InvalidArgument(
            f"{kind} golden inputs would take {total:,} bytes in the model's dtypes; the "
            f"limit is {MAX_GOLDEN_INPUT_BYTES:,}: use smaller shapes"
        )


def reference_golden(
    inputs: Mapping[str, np.ndarray],
    outputs: Mapping[str, np.ndarray],
    variant_tolerances: Mapping[str, Tolerance] | None = None,
) -> bytes:
    """Return the golden data to store: the inputs and fp32's outputs, as runtime reads it."""
    for name, array in outputs.items():
        if not np.isfinite(array).all():
            raise errors.InvalidModel(
                f"fp32 output {name!r:.64} is not finite on the golden inputs: "
                "pass realistic inputs with --golden"
            )
    total = sum(a.nbytes for a in inputs.values()) + sum(a.nbytes for a in outputs.values())
    if total > MAX_GOLDEN_BYTES:  # what runtime.golden (a device) would refuse to read
        raise errors.InvalidModel(
            f"golden inputs and outputs take {total:,} bytes; the limit is "
            f"{MAX_GOLDEN_BYTES:,}: use smaller golden inputs"
        )
    golden = Golden(dict(inputs), dict(outputs), variant_tolerances=dict(variant_tolerances or {}))
    return golden.to_npz()


def accuracy(
    variant: str,
    reference: Mapping[str, np.ndarray],
    outputs: Mapping[str, np.ndarray],
    request: GoldenRequest,
) -> AccuracyBar:
    """Compare a variant's outputs with fp32's and say which bars they miss.

    The bars are `request.min_cosine` on every output, and the relative error that cosine
    allows at the right scale, sqrt(2 * (1 - min_cosine)): cosine alone would pass an
    output 15 times too small. Whether a variant that misses one is refused or kept marked
    degraded is `refuse_degraded`'s call, once every variant has been judged.
    """
    per_output = output_errors(reference, outputs)
    figures = {
        "cosine": min(e.cosine for e in per_output.values()),
        "max_abs_error": max(e.max_abs_error for e in per_output.values()),
        "relative_error": max(e.relative_error for e in per_output.values()),
        "min_cosine": request.min_cosine,
        "outputs": [{"name": name, **e._asdict()} for name, e in per_output.items()],
    }
    self_test = Tolerance(
        min_cosine=max(0.0, min(Tolerance().min_cosine, figures["cosine"]) - SELF_TEST_SLACK)
    )
    failed = accuracy_bars.failed_bars(figures)
    return AccuracyBar(
        _json_safe(figures), degraded=bool(failed), self_test=self_test, variant=variant
    )


def refuse_degraded(bars: Mapping[str, AccuracyBar], request: GoldenRequest) -> None:
    """Refuse the push if any variant is degraded, naming each variant and its bars.

    With `allow_degraded` nothing is refused: degraded variants are kept, marked. The
    message gives every variant's verdict (the bar each degraded one failed, the figures
    of those that passed), so one push tells the publisher everything.
    """
    refused = [bar for bar in bars.values() if bar.degraded]
    if not refused or request.allow_degraded:
        return
    parts = [f"{bar.variant} degraded: {accuracy_bars.reason(bar.figures)}" for bar in refused]
    parts += [
        f"{bar.variant} passed: {accuracy_bars.reason(bar.figures)}"
        for bar in bars.values()
        if not bar.degraded
    ]
    names = " and ".join(bar.variant for bar in refused)
    them = "it" if len(refused) == 1 else "them"
    raise errors.InvalidModel(
        "; ".join(parts) + f"; nothing stored: pass --allow-degraded to keep {names} marked "
        f"degraded, or drop {them} from --variant"
    )


def _unknown_hints(inputs: Sequence[TensorSpec], request: GoldenRequest) -> str:
    """Say which --input-shape/--input-range names are not inputs of the model ("": none)."""
    names = {spec.name for spec in inputs}
    unknown = [
        f"{flag} names {name!r:.64}"
        for flag, given in (
            ("--input-shape", request.input_shapes),
            ("--input-range", request.input_ranges),
        )
        for name in given
        if name not in names
    ]
    if not unknown:
        return ""
    which = "is not an input" if len(unknown) == 1 else "are not inputs"
    return (
        f"{' and '.join(unknown)}, which {which} of the model (inputs: {', '.join(sorted(names))})"
    )


def _publisher_inputs(
    inputs: Sequence[TensorSpec], request: GoldenRequest
) -> dict[str, np.ndarray]:
    try:
        arrays = read_npz(request.golden, "--golden", MAX_GOLDEN_INPUT_BYTES)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None
    names = [spec.name for spec in inputs]
    extra = sorted(set(arrays) - set(names))
    if extra:
        raise errors.InvalidArgument(
            f"--golden has {extra[0]!r:.64}, which is not an input of the model "
            f"(inputs: {', '.join(names)})"
        )
    missing = [repr(spec.name) for spec in inputs if spec.name not in arrays]
    if len(missing) == 1:
        raise errors.InvalidArgument(f"--golden has no array for input {missing[0]}")
    if missing:
        raise errors.InvalidArgument(f"--golden has no arrays for inputs {', '.join(missing)}")
    # Checked before casting: a bool array cast to float64 grows eightfold.
    _check_total({s.name: (arrays[s.name].shape, s.dtype) for s in inputs}, "--golden")
    found = {}
    for spec in inputs:
        found[spec.name] = _cast(spec, arrays[spec.name])
        _publisher_shape(spec, found[spec.name].shape, request)
    return found


def _publisher_shape(spec: TensorSpec, shape: tuple[int, ...], request: GoldenRequest) -> None:
    hint = request.input_shapes.get(spec.name)
    if hint is not None and tuple(hint) != tuple(shape):
        raise errors.InvalidArgument(
            f"--golden input {spec.name!r} has shape {list(shape)}, "
            f"but --input-shape says {list(hint)}"
        )
    _check_shape(spec, tuple(shape), "--golden input")


def _check_shape(spec: TensorSpec, shape: tuple[int, ...], what: str) -> None:
    problem = _shape_problem(spec, shape, what)
    if problem:
        raise errors.InvalidArgument(problem)


def _shape_problem(spec: TensorSpec, shape: tuple[int, ...], what: str) -> str:
    declared = spec.shape
    fits = len(declared) == len(shape) and all(
        d < 0 or d == s for d, s in zip(declared, shape, strict=True)
    )
    if declared and not fits:  # () = MNN could not say; the run will judge
        takes = _shape_text(declared)
        return f"{what} {spec.name!r} has shape {list(shape)}; the model takes {takes}"
    return ""


def _cast(spec: TensorSpec, array: np.ndarray) -> np.ndarray:
    """Return `array` in the input's dtype, refusing conversions that change values."""
    want = spec.dtype
    if array.dtype.kind not in "biuf":
        raise errors.InvalidArgument(f"--golden input {spec.name!r} is {array.dtype}, not numeric")
    if want in _FLOAT_DTYPES:
        return np.ascontiguousarray(array, dtype=want)
    if want in _INT_DTYPES:
        converted = array.astype(want)
        if array.dtype.kind == "f" or not np.array_equal(converted, array):
            raise errors.InvalidArgument(
                f"--golden input {spec.name!r} is {array.dtype}; the model takes {want} "
                "and these values do not fit"
            )
        return np.ascontiguousarray(converted)
    raise errors.InvalidArgument(f"input {spec.name!r} has unsupported dtype {want}")


def _seeded(
    spec: TensorSpec,
    shape: tuple[int, ...],
    bounds: tuple[float, float] | tuple[int, int] | None,
    rng: np.random.Generator,
) -> np.ndarray:
    if spec.dtype in _FLOAT_DTYPES:
        if bounds is None:
            return rng.standard_normal(shape).astype(spec.dtype)
        return rng.uniform(bounds[0], bounds[1], shape).astype(spec.dtype)
    assert bounds is not None  # _seeded_bounds gave integer inputs theirs
    return rng.integers(bounds[0], bounds[1], shape, dtype=spec.dtype, endpoint=True)


def _seeded_bounds(
    spec: TensorSpec, request: GoldenRequest, problems: list[str], flags: list[str]
) -> tuple[float, float] | tuple[int, int] | None:
    """Return the range of an input's seeded values; add to `problems` what is missing."""
    bounds = request.input_ranges.get(spec.name)
    if spec.dtype in _FLOAT_DTYPES:
        return bounds
    if spec.dtype not in _INT_DTYPES:
        problems.append(f"input {spec.name!r} has unsupported dtype {spec.dtype}")
        return None
    if bounds is None:
        problems.append(
            f"input {spec.name!r} is {spec.dtype}: random values would be meaningless "
            "(a sample rate, token ids...)"
        )
        flags.append(f"--input-range {spec.name}=LOW:HIGH")
        return None
    low, high = math.ceil(bounds[0]), math.floor(bounds[1])
    info = np.iinfo(spec.dtype)
    if low > high or low < info.min or high > info.max:
        problems.append(
            f"--input-range {spec.name}={bounds[0]:g}:{bounds[1]:g} holds no {spec.dtype} value"
        )
        return None
    return low, high


def _seeded_shape(
    spec: TensorSpec, request: GoldenRequest, problems: list[str], flags: list[str]
) -> tuple[int, ...]:
    """Return an input's seeded shape; add to `problems` (and `flags`) what is missing."""
    hint = request.input_shapes.get(spec.name)
    if hint is not None:
        shape = tuple(hint)
        problem = _shape_problem(spec, shape, "--input-shape for")
        if problem:
            problems.append(problem)
        return shape
    if spec.shape and all(d >= 0 for d in spec.shape):
        return spec.shape
    if spec.shape:
        problems.append(f"input {spec.name!r} has dynamic shape {_shape_text(spec.shape)}")
        dims = ",".join("N" if d < 0 else str(d) for d in spec.shape)
        flags.append(f"--input-shape {spec.name}={dims}")
    elif spec.dtype == "unknown":
        problems.append(f"input {spec.name!r} has a shape MNN could not tell")
        flags.append(f"--input-shape {spec.name}=D1,D2,...")
    return ()  # a scalar, when nothing is missing


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join("?" if d < 0 else str(d) for d in shape) + "]"


def _json_safe(figures: dict[str, Any]) -> dict[str, Any]:
    """Replace infinities (a missing or non-finite output) with None: JSON has no inf."""

    def clean(value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean(figures)


def npz_bytes(arrays: Mapping[str, np.ndarray]) -> bytes:
    """Serialise arrays as an uncompressed ``.npz`` (what the MNN worker reads)."""
    return write_npz(arrays)
