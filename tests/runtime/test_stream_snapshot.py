"""Snapshots, restores and changing triggers mid-stream, against uninterrupted engines."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.stream import (
    Feature,
    Firings,
    SnapshotError,
    SnapshotMismatchError,
    StreamEngine,
    count,
    sliding,
)
from runtime.stream_snapshot import FORMAT_VERSION

from ._stream_helpers import COLUMNS, assert_same_firings, batch, engine_pair
from .test_stream_properties import scenarios

Rows = list[tuple[int, int, list[int], list[float]]]


def _rows(scenario: dict[str, Any]) -> Rows:
    return [r for rows, _ in scenario["batches"] for r in rows]


def _push(engine: Any, rows: Rows, config: dict[str, Any]) -> Firings:
    return engine.push_batch(*batch(rows, len(config["key_fields"]), len(config["value_fields"])))


def _build(config: dict[str, Any], triggers: list, removed: tuple[int, ...] = ()) -> StreamEngine:
    engine = StreamEngine(**config)
    for pattern, by, within, features in triggers:
        engine.add_trigger(pattern, by=by, within_ms=within, features=features)
    for tid in removed:
        engine.remove_trigger(tid)
    return engine


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.floats(0, 1))
def test_restored_engine_fires_like_one_that_never_stopped(
    scenario: dict[str, Any], where: float
) -> None:
    config, triggers = scenario["config"], scenario["triggers"]
    rows = _rows(scenario)
    cut = int(where * len(rows))
    straight, reference = engine_pair(triggers, **config)
    before = _build(config, triggers)
    assert_same_firings(_push(before, rows[:cut], config), _push(straight, rows[:cut], config), 0)
    _push(reference, rows[:cut], config)
    data = before.snapshot()
    restored = _build(config, triggers)
    restored.restore(data)
    assert restored.snapshot() == data
    assert restored.stats() == {**before.stats(), "state_bytes": restored.stats()["state_bytes"]}
    got = _push(restored, rows[cut:], config)
    assert_same_firings(got, _push(straight, rows[cut:], config), len(triggers))
    assert_same_firings(got, _push(reference, rows[cut:], config), len(triggers))


def _only(firings: Firings, ids: range, shift: int = 0) -> dict[str, np.ndarray]:
    mask = np.isin(firings.trigger_id, np.array(ids, dtype=np.int32))
    out = {name: getattr(firings, name)[mask] for name in COLUMNS if name != "row"}
    out["trigger_id"] = out["trigger_id"] - shift
    for tid in ids:
        out[f"features{tid - shift}"] = firings.features(tid)
    return out


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-9, atol=1e-9, equal_nan=True)


@st.composite
def changes(draw: st.DrawFn) -> dict[str, Any]:
    scenario = draw(scenarios())
    # Keys of added triggers count towards max_keys, and key TTLs run on the watermark
    # a fresh engine does not have: both would make the comparisons below unequal.
    scenario["config"] = {**scenario["config"], "max_keys": 1000, "key_ttl_ms": None}
    rows = _rows(scenario)
    cuts = sorted(draw(st.lists(st.integers(0, len(rows)), min_size=2, max_size=2)))
    triggers = scenario["triggers"]
    kept = draw(st.integers(1, len(triggers)))
    doomed = triggers[kept:]
    added = draw(st.lists(st.sampled_from(triggers), min_size=1, max_size=2))
    return {
        **scenario,
        "rows": rows,
        "cuts": cuts,
        "kept": triggers[:kept],
        "doomed": doomed,
        "added": added,
    }


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(changes())
def test_adding_and_removing_triggers_keeps_the_others_windows(case: dict[str, Any]) -> None:
    config, rows, (a, b) = case["config"], case["rows"], case["cuts"]
    kept, doomed, added = case["kept"], case["doomed"], case["added"]
    n_kept, n_old = len(kept), len(kept) + len(doomed)
    live = _build(config, kept + doomed)
    untouched = _build(config, kept)
    fresh, reference = engine_pair(added, **config)  # the added triggers, from the change on
    _push(live, rows[:a], config)
    _push(untouched, rows[:a], config)
    for tid in range(n_kept, n_old):
        live.remove_trigger(tid)
    for pattern, by, within, features in added:
        live.add_trigger(pattern, by=by, within_ms=within, features=features)
    new_ids = range(n_old, n_old + len(added))
    got = _push(live, rows[a:b], config)
    want = _push(untouched, rows[a:b], config)
    _assert_same(_only(got, range(n_kept)), _only(want, range(n_kept)))
    assert not set(got.trigger_id.tolist()) & set(range(n_kept, n_old))  # removed: silent
    for other in (_push(fresh, rows[a:b], config), _push(reference, rows[a:b], config)):
        _assert_same(_only(got, new_ids, shift=n_old), _only(other, range(len(added))))

    # A snapshot taken after the changes restores into an engine built the same way...
    data = live.snapshot()
    rebuilt = _build(config, kept + doomed + added, removed=tuple(range(n_kept, n_old)))
    rebuilt.restore(data)
    got, want = _push(rebuilt, rows[b:], config), _push(live, rows[b:], config)
    assert_same_firings(got, want, n_old + len(added))
    # ...and only into one: without the removals, or without the added triggers.
    if doomed:
        with pytest.raises(SnapshotMismatchError, match=f"trigger {n_kept}: .*removed"):
            _build(config, kept + doomed + added).restore(data)
    with pytest.raises(SnapshotMismatchError, match=f"trigger {n_old} only in the snapshot"):
        _build(config, kept + doomed, removed=tuple(range(n_kept, n_old))).restore(data)


CONFIG = {
    "event_types": ["view", "click"],
    "key_fields": ["item"],
    "value_fields": ["price"],
    "lateness_ms": 50,
}
TRIGGERS = [
    ("view ~> click", "item", None, [Feature("mean", "price", sliding(1_000))]),
    ("click[price>2]", "item", 500, [Feature("max", "price", count(3))]),
]


def _engine_with_state() -> tuple[StreamEngine, bytes]:
    engine = _build(CONFIG, TRIGGERS)
    rng = np.random.default_rng(3)
    rows = [
        (int(t), int(rng.integers(2)), [int(rng.integers(5))], [float(rng.integers(5))])
        for t in np.sort(rng.integers(0, 5_000, 300))
    ]
    _push(engine, rows, CONFIG)
    return engine, engine.snapshot()


def test_mismatched_trigger_sets_and_configs_are_named() -> None:
    _, data = _engine_with_state()
    other = _build(CONFIG, [TRIGGERS[0], (*TRIGGERS[1][:3], [Feature("min", "price", count(3))])])
    with pytest.raises(SnapshotMismatchError, match=r"trigger 1: snapshot 'click\[price>2\]'"):
        other.restore(data)
    with pytest.raises(SnapshotMismatchError, match="trigger 1 only in the snapshot"):
        _build(CONFIG, TRIGGERS[:1]).restore(data)
    with pytest.raises(SnapshotMismatchError, match="config lateness_ms: snapshot 50, engine 0"):
        _build({**CONFIG, "lateness_ms": 0}, TRIGGERS).restore(data)
    # Spelling is not meaning: the same pattern written differently restores.
    respelled = [("view  ~>click", *TRIGGERS[0][1:]), TRIGGERS[1]]
    _build(CONFIG, respelled).restore(data)


def test_damaged_snapshots_are_refused_and_change_nothing() -> None:
    engine, data = _engine_with_state()
    target = _build(CONFIG, TRIGGERS)
    with pytest.raises(SnapshotError, match="not a stream engine snapshot"):
        target.restore(b"hello")
    with pytest.raises(SnapshotError, match="a snapshot is bytes"):
        target.restore("SKSTREAM")  # type: ignore[arg-type]
    newer = data[:8] + (FORMAT_VERSION + 1).to_bytes(2, "little") + data[10:]
    with pytest.raises(SnapshotError, match=f"format version {FORMAT_VERSION + 1}"):
        target.restore(newer)
    with pytest.raises(SnapshotError, match="truncated"):
        target.restore(data[:-1])
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x10
    with pytest.raises(SnapshotError, match="checksum mismatch"):
        target.restore(bytes(flipped))
    assert target.stats()["events"] == 0
    target.restore(data)
    assert {**target.stats(), "state_bytes": 0} == {**engine.stats(), "state_bytes": 0}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_damage_raises_only_snapshot_errors(data: st.DataObject) -> None:
    _, good = _engine_with_state()
    kind = data.draw(st.sampled_from(("bytes", "truncate", "flip", "flip_resealed")))
    if kind == "bytes":
        bad = data.draw(
            st.binary(max_size=300) | st.binary(max_size=40).map(lambda b: good[:60] + b)
        )
    elif kind == "truncate":
        bad = good[: data.draw(st.integers(0, len(good) - 1))]
    else:
        at = data.draw(st.integers(0, len(good) - 17))
        bad = bytearray(good)
        bad[at] ^= 1 << data.draw(st.integers(0, 7))
        if kind == "flip_resealed":  # a valid checksum: the native checks must catch it
            bad[-16:] = hashlib.sha256(bytes(bad[:-16])).digest()[:16]
        bad = bytes(bad)
    target = _build(CONFIG, TRIGGERS)
    try:
        target.restore(bad)
    except SnapshotError:
        assert target.stats()["events"] == 0  # refused: unchanged
    else:
        assert kind == "flip_resealed"  # a flip that still describes some valid state
    target.push(2**62, "click", [1], [3.0])  # and the engine still works (never late)
