"""Fast paths of the native engine against its general ones: windows scanned from a key's
few rows with one stat (computed as the scan meets the rows) against the same windows
with a second stat (rows picked, then finished), bit for bit; `->` edges with more event
types than the per-type index serves, against the reference."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.stream import Feature, StreamEngine, Window, count, sliding, tumbling

from ._stream_helpers import assert_same_firings, batch, engine_pair

# Sums that cancel ([1e16, 1, -1e16]), signed zeros (ties of min and max), plain values.
VALUES = np.array([-1e16, -2.0, -1.0, -0.0, 0.0, 1e-8, 0.5, 1.0, 2.5, 1000.25, 1e16, 1e16 + 2])
WINDOWS = [sliding(50), sliding(400), tumbling(100), count(5), count(30)]


def _stream(seed: int, n: int = 4_000) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    # Dense enough for late rows and shared timestamps, sparse per key (20 keys): a
    # key's windows hold a few rows, which are scanned rather than kept running.
    ts = np.maximum(np.cumsum(rng.integers(0, 20, n)) - rng.integers(0, 30, n), 0)
    keys = rng.integers(0, 20, (n, 1))
    values = VALUES[rng.integers(0, len(VALUES), (n, 1))]
    return ts.astype(np.int64), np.zeros(n, np.int32), keys.astype(np.int64), values


def _column(
    agg: str, window: Window, other: str | None, stream: tuple[np.ndarray, ...]
) -> np.ndarray:
    engine = StreamEngine(event_types=["a"], key_fields=["k"], value_fields=["x"], lateness_ms=30)
    field = None if agg == "count" else "x"
    features = [Feature(agg, field, window)]
    if other is not None:  # a second stat of the same window: the rows are picked
        features.append(Feature(other, None if other == "count" else "x", window))
    engine.add_trigger("a", by="k", features=features)
    got = engine.push_batch(*stream)
    assert len(got) == len(stream[0])
    return got.features(0)[:, 0].copy()


@pytest.mark.parametrize("agg", ["count", "sum", "mean", "min", "max", "last"])
@pytest.mark.parametrize("window", WINDOWS, ids=repr)
def test_one_stat_windows_equal_picked_rows_bit_for_bit(agg: str, window: Window) -> None:
    for seed in range(3):
        stream = _stream(seed)
        streamed = _column(agg, window, None, stream)
        picked = _column(agg, window, "sum" if agg == "count" else "count", stream)
        np.testing.assert_array_equal(streamed.view(np.int64), picked.view(np.int64))


def test_contiguous_steps_with_many_event_types_match_reference() -> None:
    """70 event types: past the per-type index of `->` edges (64), the scan of them."""
    types = [f"t{i}" for i in range(70)]
    used = [0, 1, 2, 3, 64, 65, 66, 69]
    rng = np.random.default_rng(5)
    triggers = []
    for _ in range(30):
        steps = [types[used[i]] for i in rng.integers(0, len(used), rng.integers(1, 4))]
        pattern = steps[0]
        for step in steps[1:]:
            pattern += str(rng.choice([" -> ", " ~> "])) + step
        triggers.append((pattern, "k", 500, [Feature("count", window=sliding(100))]))
    native, reference = engine_pair(
        triggers, event_types=types, key_fields=["k"], value_fields=[], lateness_ms=0
    )
    n = 3_000
    rows = [
        (i, used[int(rng.integers(0, len(used)))], [int(rng.integers(0, 3))], []) for i in range(n)
    ]
    for lo in range(0, n, 1_000):
        arrays = batch(rows[lo : lo + 1_000], 1, 0)
        got = native.push_batch(*arrays)
        assert_same_firings(got, reference.push_batch(*arrays), len(triggers))
        assert len(got) > 0
