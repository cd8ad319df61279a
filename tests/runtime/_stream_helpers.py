"""Building matching native/reference engines and comparing their firings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from runtime.stream import Feature, Firings, StreamEngine
from runtime.stream_reference import ReferenceEngine


def engine_pair(
    triggers: Sequence[tuple[str, str, int | None, Sequence[Feature]]], **config: Any
) -> tuple[StreamEngine, ReferenceEngine]:
    native = StreamEngine(**config)
    for pattern, by, within, features in triggers:
        native.add_trigger(pattern, by=by, within_ms=within, features=features)
    reference = ReferenceEngine(native.config)
    for spec in native.triggers:
        reference.add_trigger(spec)
    return native, reference


def batch(
    rows: Sequence[tuple[int, int, Sequence[int], Sequence[float]]], n_keys: int, n_values: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return (
        np.array([r[0] for r in rows], dtype=np.int64),
        np.array([r[1] for r in rows], dtype=np.int32),
        np.array([list(r[2]) for r in rows], dtype=np.int64).reshape(len(rows), n_keys),
        np.array([list(r[3]) for r in rows], dtype=np.float64).reshape(len(rows), n_values),
    )


COLUMNS = ("trigger_id", "key", "ts", "event_index", "window_start", "window_end", "row")


def assert_same_firings(native: Firings, reference: Firings, n_triggers: int) -> None:
    for name in COLUMNS:
        got, want = getattr(native, name), getattr(reference, name)
        assert got.dtype == want.dtype, name
        np.testing.assert_array_equal(got, want, err_msg=name)
    assert native.fired_triggers == reference.fired_triggers
    for tid in range(n_triggers):
        got, want = native.features(tid), reference.features(tid)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, equal_nan=True)
