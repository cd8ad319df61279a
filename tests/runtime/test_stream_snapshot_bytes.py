"""The snapshot's bytes are pinned: a snapshot written by an earlier build restores and
writes itself again byte for byte, and the same pushes write the same bytes.

The fixture (stream_snapshot_golden.bin, next to this file) was written by the engine as
of f90e254, before the per-key state moved into one block: a change of layout in memory
must not change the format. It holds keys of two groups (two partition fields), a second
generation of triggers, a removed trigger, sorted rings (time windows of more than 32
rows) and a long count window. Regenerate it only on a deliberate format change (with a
new FORMAT_VERSION): `python -m tests.runtime.test_stream_snapshot_bytes`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from runtime.stream import Feature, Firings, StreamEngine, count, sliding

from ._stream_helpers import assert_same_firings, batch

FIXTURE = Path(__file__).with_name("stream_snapshot_golden.bin")
CONFIG: dict[str, Any] = {
    "event_types": ["view", "click", "buy"],
    "key_fields": ["item", "user"],
    "value_fields": ["price", "qty"],
    "lateness_ms": 50,
}
FIRST = [
    ("view ~> click", "item", None, [Feature("mean", "price", sliding(1_000))]),
    ("click -> buy[price>2]", "user", 2_000, [Feature("max", "qty", count(40))]),
    ("view -> click ~> buy", "item", 3_000, [Feature("count", window=sliding(500))]),
    ("buy ~> view -> click", "user", None, []),
]
LATER = [("buy -> buy", "item", 1_000, [Feature("sum", "qty", sliding(2_000))])]
REMOVED = (2,)


def _rows(seed: int, start: int, n: int) -> list[tuple[int, int, list[int], list[float]]]:
    rng = np.random.default_rng(seed)
    ts = np.maximum(start + np.arange(n) * 7 - rng.integers(0, 51, n), start)
    return [
        (
            int(t),
            int(rng.integers(3)),
            [int(rng.integers(3)), int(rng.integers(4))],
            [float(rng.integers(6)), float(rng.integers(1, 9))],
        )
        for t in ts
    ]


def _push(engine: StreamEngine, rows: list) -> Firings:
    return engine.push_batch(*batch(rows, 2, 2))


def _engine() -> StreamEngine:
    engine = StreamEngine(**CONFIG)
    for pattern, by, within, features in FIRST:
        engine.add_trigger(pattern, by=by, within_ms=within, features=features)
    return engine


def golden_engine() -> StreamEngine:
    """The engine whose state the fixture holds, built the same way every time."""
    engine = _engine()
    _push(engine, _rows(1, 0, 400))
    for pattern, by, within, features in LATER:  # after a push: a second generation
        engine.add_trigger(pattern, by=by, within_ms=within, features=features)
    for tid in REMOVED:
        engine.remove_trigger(tid)
    _push(engine, _rows(2, 2_800, 300))
    return engine


def _fresh() -> StreamEngine:
    engine = _engine()
    for pattern, by, within, features in LATER:
        engine.add_trigger(pattern, by=by, within_ms=within, features=features)
    for tid in REMOVED:
        engine.remove_trigger(tid)
    return engine


def test_the_same_state_writes_the_pinned_bytes() -> None:
    assert golden_engine().snapshot() == FIXTURE.read_bytes()


def test_a_pinned_snapshot_restores_to_the_same_bytes_and_firings() -> None:
    data = FIXTURE.read_bytes()
    restored = _fresh()
    restored.restore(data)
    assert restored.snapshot() == data
    straight = golden_engine()
    assert restored.stats() == {**straight.stats(), "state_bytes": restored.stats()["state_bytes"]}
    more = _rows(3, 4_900, 300)
    assert_same_firings(_push(restored, more), _push(straight, more), len(FIRST) + len(LATER))
    assert restored.snapshot() == straight.snapshot()


if __name__ == "__main__":  # writes the fixture (see the module's docstring)
    FIXTURE.write_bytes(golden_engine().snapshot())
