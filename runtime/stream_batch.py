"""The array side of the stream engine: checking pushed batches, holding firings.

Shared by the native engine's facade (`runtime.stream`) and the pure-Python reference,
so both accept exactly the same arrays and return the same `Firings` type.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from runtime.stream_spec import BatchFormatError

__all__ = ["Firings", "check_batch"]

_BATCH_DTYPES = (("ts", np.int64, 1), ("types", np.int32, 1), ("keys", np.int64, 2))


def check_batch(
    ts: object, types: object, keys: object, values: object, n_keys: int, n_values: int
) -> tuple[NDArray[np.int64], NDArray[np.int32], NDArray[np.int64], NDArray[np.float64]]:
    """Check dtypes and shapes of a batch and return C-contiguous arrays.

    Only numpy arrays of exactly the documented dtypes are accepted, so nothing is ever
    silently cast (a float timestamp or an int64 type code is an error, not a guess).
    """
    if _well_formed(ts, types, keys, values, n_keys, n_values):
        return ts, types, keys, values  # type: ignore[return-value]
    arrays = []
    for (name, dtype, ndim), array in zip(
        (*_BATCH_DTYPES, ("values", np.float64, 2)), (ts, types, keys, values), strict=True
    ):
        if not isinstance(array, np.ndarray):
            raise BatchFormatError(f"{name} must be a numpy array, got {type(array).__name__}")
        if array.dtype != dtype:
            raise BatchFormatError(
                f"{name} must have dtype {np.dtype(dtype).name}, got {array.dtype.name}"
            )
        if array.ndim != ndim:
            raise BatchFormatError(f"{name} must be {ndim}-D, got shape {array.shape}")
        arrays.append(np.ascontiguousarray(array))
    n = arrays[0].shape[0]
    expected = {"types": (n,), "keys": (n, n_keys), "values": (n, n_values)}
    for name, array in zip(("types", "keys", "values"), arrays[1:], strict=True):
        if array.shape != expected[name]:
            raise BatchFormatError(
                f"{name} must have shape {expected[name]} for {n} events, got {array.shape}"
            )
    return arrays[0], arrays[1], arrays[2], arrays[3]


_I64, _I32, _F64 = np.dtype(np.int64), np.dtype(np.int32), np.dtype(np.float64)


def _well_formed(ts: Any, types: Any, keys: Any, values: Any, n_keys: int, n_values: int) -> bool:
    """Check the common case in one expression: a one-event push must cost microseconds.

    Anything else (another dtype instance, a non-contiguous view, a wrong shape) goes
    through the full checks, which either pass it on or name the problem.
    """
    try:
        n = ts.shape[0]
        return (
            type(ts) is type(types) is type(keys) is type(values) is np.ndarray
            and ts.dtype is _I64
            and types.dtype is _I32
            and keys.dtype is _I64
            and values.dtype is _F64
            and ts.shape == (n,)
            and types.shape == (n,)
            and keys.shape == (n, n_keys)
            and values.shape == (n, n_values)
            and ts.flags.c_contiguous
            and types.flags.c_contiguous
            and keys.flags.c_contiguous
            and values.flags.c_contiguous
        )
    except (AttributeError, IndexError, TypeError):
        return False


class Firings:
    """The trigger firings of one push, in (event_index, trigger_id) order.

    Per firing i: `trigger_id[i]`, partition `key[i]`, the firing event's `ts[i]` and
    `event_index[i]` (its position in the pushed batch), the hull of its feature windows
    `[window_start[i], window_end[i])`, and `row[i]`, its row in `features(trigger_id[i])`.
    Feature matrices are grouped per trigger so each is ready as one model input batch;
    the native engine's matrices are views of its own buffers (no copy).
    """

    __slots__ = ("_features", "_widths", "event_index", "key", "row", "trigger_id", "ts")
    __slots__ += ("window_end", "window_start")

    def __init__(
        self,
        columns: dict[str, NDArray[np.int64] | NDArray[np.int32]],
        features: dict[int, NDArray[np.float64]],
        widths: Sequence[int],
    ) -> None:
        self.trigger_id: NDArray[np.int32] = columns["trigger_id"]  # type: ignore[assignment]
        self.key: NDArray[np.int64] = columns["key"]  # type: ignore[assignment]
        self.ts: NDArray[np.int64] = columns["ts"]  # type: ignore[assignment]
        self.event_index: NDArray[np.int64] = columns["event_index"]  # type: ignore[assignment]
        self.window_start: NDArray[np.int64] = columns["window_start"]  # type: ignore[assignment]
        self.window_end: NDArray[np.int64] = columns["window_end"]  # type: ignore[assignment]
        self.row: NDArray[np.int64] = columns["row"]  # type: ignore[assignment]
        self._features = features
        self._widths = tuple(widths)

    def __len__(self) -> int:
        return int(self.trigger_id.shape[0])

    def __repr__(self) -> str:
        fired = {t: int(m.shape[0]) for t, m in sorted(self._features.items())}
        return f"Firings({len(self)} firings, per trigger {fired})"

    def features(self, trigger_id: int) -> NDArray[np.float64]:
        """Return the (n_firings_of_trigger, width) feature matrix of one trigger."""
        if not 0 <= trigger_id < len(self._widths):
            raise KeyError(f"no trigger {trigger_id}")
        matrix = self._features.get(trigger_id)
        if matrix is None:
            return np.empty((0, self._widths[trigger_id]), dtype=np.float64)
        return matrix

    def feature_row(self, i: int) -> NDArray[np.float64]:
        """Return the feature vector of firing i (a view into its trigger's matrix)."""
        return self.features(int(self.trigger_id[i]))[int(self.row[i])]

    @property
    def fired_triggers(self) -> tuple[int, ...]:
        """Ids of the triggers that fired at least once, ascending."""
        return tuple(sorted(self._features))
