"""Checks of what a caller hands `Model`: shape hints, and finiteness of inputs and outputs.

Kept apart from `runtime.model` so the model's control flow reads on its own; these
run on every request (the finiteness checks) and must stay cheap in the common case.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence

import numpy as np

from runtime.backends import BackendConfig
from runtime.errors import InvalidInput
from runtime.signature import Signature

__all__ = ["blame_inputs", "check_deadline", "non_finite", "refuse_non_finite", "shape_hints"]

MAX_HINTED_ELEMENTS = 32 << 20  # 128 MiB of float32 zeros per probe


def check_deadline(deadline_s: object) -> None:
    """Refuse a deadline that would bound nothing, fail every request, or overflow a wait.

    0 or less would kill a worker on every request (or, as a lock timeout, wait for
    ever); NaN, infinity and values past the platform's longest wait raise deep inside.
    """
    is_number = isinstance(deadline_s, int | float) and not isinstance(deadline_s, bool)
    if not is_number or not 0 < deadline_s <= threading.TIMEOUT_MAX:
        raise ValueError(
            f"deadline_s must be a number of seconds in (0, {threading.TIMEOUT_MAX:g}], "
            f"not {deadline_s!r}"
        )


def shape_hints(hints: Mapping[str, Sequence[int]] | None) -> dict[str, tuple[int, ...]]:
    """Check `input_shapes` (name -> positive dims); InvalidInput names what is wrong."""
    if hints is None:
        return {}
    if not isinstance(hints, Mapping):
        raise InvalidInput(f"input_shapes must map input names to shapes, not {hints!r}")
    shapes = {}
    for name, shape in hints.items():
        is_dims = isinstance(shape, Sequence) and not isinstance(shape, str)
        if not is_dims or not all(_positive_int(n) for n in shape):
            raise InvalidInput(f"input_shapes[{name!r}] must be positive ints, not {shape!r}")
        shapes[str(name)] = tuple(int(n) for n in shape)
    # Probes fill these with zeros (8 bytes per element at most): bound what that takes.
    elements = sum(math.prod(shape) for shape in shapes.values())
    if elements > MAX_HINTED_ELEMENTS:
        raise InvalidInput(
            f"input_shapes ask for {elements:,} elements in all; the limit is "
            f"{MAX_HINTED_ELEMENTS:,}"
        )
    return shapes


def _positive_int(n: object) -> bool:
    return isinstance(n, int | np.integer) and not isinstance(n, bool) and n > 0


def _all_finite(arrays: Sequence[np.ndarray]) -> bool:
    """Tell whether every float array is finite, cheaply in the common case.

    A dot product of an array with itself is finite exactly when no element is inf or
    NaN, unless it overflows; only then (or on a non-finite result) is every element
    checked. It is a few times cheaper than np.isfinite(...).all() on small arrays.
    """
    for array in arrays:
        if array.dtype.kind != "f" or not array.size:
            continue
        flat = array.reshape(-1)
        if not math.isfinite(flat.dot(flat)) and not np.isfinite(flat).all():
            return False
    return True


def non_finite(outputs: Mapping[str, np.ndarray]) -> str:
    """Name the outputs holding NaN or inf ("" when all are finite)."""
    if _all_finite(list(outputs.values())):
        return ""
    return ", ".join(name for name, a in outputs.items() if not _all_finite([a]))


def refuse_non_finite(signature: Signature, arrays: Sequence[np.ndarray]) -> None:
    """Raise InvalidInput naming the first input (in model order) holding NaN or inf."""
    if not _all_finite(arrays):
        specs = signature.inputs
        name = next(s.name for s, a in zip(specs, arrays, strict=True) if not _all_finite([a]))
        raise InvalidInput(f"input {name!r} holds NaN or infinity")


def blame_inputs(bad: str, first: BackendConfig | None, second: BackendConfig) -> str:
    """Explain why non-finite outputs are the inputs' fault, not the config's."""
    if first is None:
        why = f"{second.key} still matches the golden data"
    else:
        why = f"{first.key} and {second.key} both give them"
    return f"these inputs make outputs {bad} non-finite ({why}): outside the model's domain"
