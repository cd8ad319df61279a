"""The native engine against the pure-Python reference on random engines and streams."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from runtime.stream import Feature, StreamInputError, Window
from runtime.stream_spec import AGGREGATIONS, CMP_OPS

from ._stream_helpers import assert_same_firings, batch, engine_pair

TYPES = ("a", "b", "c", "d")
KEYS = ("k0", "k1")
VALUES = ("x", "y")
# Few distinct values, so conditions, distinct counts and histogram bins all get hit.
# Huge values next to tiny ones expose naive sums ([1e16, 1, -1e16] is 0 summed left to
# right, 1 exactly), 1e16 + 2 next to 1e16 a naive variance (std 1 under mean 1e16).
VALUE_POOL = (-1e16, -2.0, -1.0, -0.0, 0.0, 1e-8, 0.5, 1.0, 2.5, 3.0, 1000.25, 1e16, 1e16 + 2)
# Time windows from milliseconds to seconds (timestamps span minutes), count windows up
# to hundreds of events.
TIME_WINDOWS = st.sampled_from((1, 7, 50, 400, 2_000, 10_000)) | st.integers(1, 20_000)
COUNT_WINDOWS = st.sampled_from((1, 2, 5, 100, 300)) | st.integers(1, 400)
# Gaps between events: bursts of equal or close timestamps, then seconds of quiet.
GAPS = st.sampled_from((0, 0, 1, 3, 20, 150, 1_000, 4_000, 20_000))


@st.composite
def conditions(draw: st.DrawFn, n_keys: int, n_values: int) -> str:
    parts = []
    # At most one condition per step most of the time, so that most scenarios fire.
    for _ in range(draw(st.sampled_from((0, 0, 0, 1, 1, 2)))):
        cmp = draw(st.sampled_from(CMP_OPS))
        if draw(st.booleans()):
            parts.append(f"{KEYS[draw(st.integers(0, n_keys - 1))]}{cmp}{draw(st.integers(0, 3))}")
        else:
            literal = draw(st.sampled_from(VALUE_POOL))
            parts.append(f"{VALUES[draw(st.integers(0, n_values - 1))]}{cmp}{literal!r}")
    return f"[{', '.join(parts)}]" if parts else ""


@st.composite
def patterns(draw: st.DrawFn, n_types: int, n_keys: int, n_values: int) -> str:
    text = ""
    for j in range(draw(st.sampled_from((1, 1, 2, 2, 3, 4)))):
        if j:
            text += draw(st.sampled_from((" -> ", " ~> ")))
        text += TYPES[draw(st.integers(0, n_types - 1))] + draw(conditions(n_keys, n_values))
    return text


@st.composite
def features(draw: st.DrawFn, n_types: int, n_values: int) -> Feature:
    agg = draw(st.sampled_from(AGGREGATIONS))
    kind = draw(st.sampled_from(("sliding", "tumbling", "count")))
    size = draw(COUNT_WINDOWS if kind == "count" else TIME_WINDOWS)
    of = draw(st.none() | st.sampled_from(TYPES[:n_types]))
    edges: tuple[float, ...] = ()
    if agg == "histogram":
        edges = tuple(sorted(draw(st.sets(st.sampled_from(VALUE_POOL[3:]), min_size=2))))
    field = None if agg == "count" else VALUES[draw(st.integers(0, n_values - 1))]
    return Feature(agg, field, Window(kind, size), of=of, edges=edges)


@st.composite
def scenarios(draw: st.DrawFn) -> dict[str, Any]:
    n_types, n_keys, n_values = (draw(st.integers(1, n)) for n in (4, 2, 2))
    lateness = draw(st.sampled_from((0, 0, 5, 30, 2_000)))
    config = {
        "event_types": TYPES[:n_types],
        "key_fields": KEYS[:n_keys],
        "value_fields": VALUES[:n_values],
        "lateness_ms": lateness,
        "max_keys": draw(st.sampled_from((1, 2, 3, 1000, 1000, 1000))),
        "key_ttl_ms": draw(st.none() | st.none() | st.integers(0, 60) | st.integers(0, 100_000)),
    }
    triggers = [
        (
            draw(patterns(n_types, n_keys, n_values)),
            KEYS[draw(st.integers(0, n_keys - 1))],
            draw(st.sampled_from((None, None, 60_000)) | st.integers(0, 60)),
            draw(st.lists(features(n_types, n_values), max_size=4)),
        )
        for _ in range(draw(st.integers(1, 6)))
    ]
    base, batches = 0, []
    for b in range(draw(st.integers(1, 3))):
        rows = []
        # The first batch has a few events at least (empty ones are covered by later ones).
        for _ in range(draw(st.integers(0 if b else 5, 60) | st.integers(20, 60))):
            base += draw(GAPS)
            rows.append(
                (
                    max(0, base - draw(st.integers(0, lateness))),  # out of order, in lateness
                    draw(st.integers(0, n_types - 1)),
                    [draw(st.integers(0, 3) | st.just(0)) for _ in range(n_keys)],
                    [draw(st.sampled_from(VALUE_POOL)) for _ in range(n_values)],
                )
            )
        bad = draw(st.sampled_from((None,) * 4 + ("late", "nan", "type")))
        batches.append((rows, bad))
    return {"config": config, "triggers": triggers, "batches": batches}


def _spoil(rows: list, bad: str, n_types: int) -> tuple[list, int]:
    """A copy of rows with one bad event at the end (its index is returned)."""
    ts, typ, keys, values = rows[-1] if rows else (0, 0, [0, 0], [0.0, 0.0])
    if bad == "late":
        # Beyond the largest lateness drawn (2,000 ms), so the event at 0 is always late.
        row = (max(r[0] for r in rows) + 10_000, typ, keys, values)
        rows = [*rows, row, (0, typ, keys, values)]  # 0 is now > lateness behind
        return rows, len(rows) - 1
    if bad == "nan":
        row = (ts, typ, keys, [float("nan")] * len(values))
    else:
        row = (ts, n_types, keys, values)
    return [*rows, row], len(rows)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_native_matches_reference(scenario: dict[str, Any]) -> None:
    config = scenario["config"]
    native, reference = engine_pair(scenario["triggers"], **config)
    n_keys, n_values = len(config["key_fields"]), len(config["value_fields"])
    n_triggers = len(scenario["triggers"])
    for rows, bad in scenario["batches"]:
        if bad and (rows or bad != "late"):
            spoiled, index = _spoil(rows, bad, len(config["event_types"]))
            arrays = batch(
                [(t, ty, k[:n_keys], v[:n_values]) for t, ty, k, v in spoiled], n_keys, n_values
            )
            before = {**native.stats(), "trie_nodes": None}
            with pytest.raises(StreamInputError) as got:
                native.push_batch(*arrays)
            with pytest.raises(StreamInputError) as want:
                reference.push_batch(*arrays)
            assert type(got.value) is type(want.value)
            assert got.value.index == want.value.index == index
            assert str(got.value) == str(want.value)
            assert {**native.stats(), "trie_nodes": None} == before
        arrays = batch(rows, n_keys, n_values)
        got = native.push_batch(*arrays)
        assert_same_firings(got, reference.push_batch(*arrays), n_triggers)
        event("fired" if len(got) else "did not fire")
    assert native.stats()["live_keys"] <= config["max_keys"]


@settings(max_examples=40, deadline=None)
@given(scenarios(), st.integers(1, 7))
def test_split_batches_fire_like_one_batch(scenario: dict[str, Any], chunk: int) -> None:
    """Batch boundaries change nothing but each firing's event index."""
    config = scenario["config"]
    n_keys, n_values = len(config["key_fields"]), len(config["value_fields"])
    rows = [r for rows, _ in scenario["batches"] for r in rows]
    whole, _ = engine_pair(scenario["triggers"], **config)
    split, _ = engine_pair(scenario["triggers"], **config)
    expected = whole.push_batch(*batch(rows, n_keys, n_values))
    pieces = [
        split.push_batch(*batch(rows[i : i + chunk], n_keys, n_values))
        for i in range(0, len(rows), chunk)
    ]
    offsets = range(0, len(rows), chunk)
    got_index = np.concatenate(
        [p.event_index + o for p, o in zip(pieces, offsets, strict=True)] or [np.empty(0, np.int64)]
    )
    np.testing.assert_array_equal(got_index, expected.event_index)
    for tid in range(len(scenario["triggers"])):
        got = np.concatenate([p.features(tid) for p in pieces] or [expected.features(tid)[:0]])
        np.testing.assert_array_equal(got, expected.features(tid))


def _reach(scenario: dict[str, Any]) -> dict[str, bool]:
    """What one scenario exercises (native engine only: this is about the generator)."""
    config = scenario["config"]
    native, _ = engine_pair(scenario["triggers"], **config)
    n_keys, n_values = len(config["key_fields"]), len(config["value_fields"])
    rows = [r for rows, _ in scenario["batches"] for r in rows]
    fired = len(native.push_batch(*batch(rows, n_keys, n_values))) if rows else 0
    windows = [f.window for _, _, _, feats in scenario["triggers"] for f in feats]
    span = max(r[0] for r in rows) - min(r[0] for r in rows) if rows else 0
    return {
        "fired": fired > 0,
        "minutes": span >= 60_000,
        "long_time_window": any(w.kind != "count" and w.size >= 1_000 for w in windows),
        "long_count_window": any(w.kind == "count" and w.size >= 100 for w in windows),
    }


def test_scenarios_reach_the_interesting_cases() -> None:
    """Most generated scenarios fire, over minutes, with windows of seconds and hundreds.

    A generator that rarely fires (or only over tiny windows) would let the comparison
    above pass while checking next to nothing; this fails if that happens.
    """
    seen: list[dict[str, bool]] = []

    # Derandomized: a share measured on 200 draws must not move from run to run.
    @settings(max_examples=200, deadline=None, database=None, derandomize=True)
    @given(scenarios())
    def collect(scenario: dict[str, Any]) -> None:
        seen.append(_reach(scenario))

    collect()
    share = {name: sum(s[name] for s in seen) / len(seen) for name in seen[0]}
    assert share["fired"] >= 0.7, share
    assert share["minutes"] >= 0.3, share
    assert share["long_time_window"] >= 0.3, share
    assert share["long_count_window"] >= 0.15, share
