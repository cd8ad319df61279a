"""Throughput of the native stream engine next to the pure-Python reference and numpy.

One synthetic app stream (20 event types, 1000 items, two value fields, one event per
ms with out-of-order arrivals inside a 100 ms lateness) is pushed through engines with
1, 100 and 1000 registered triggers (2-3 step patterns, mixed `->`/`~>`, conditions,
a 5 s span; each with count/sliding(1 s), mean/sliding(5 s) and max/count(10)
features), pinned to one core. Reported per trigger count:

* native events/s (best of a few trials, fresh engine each, whole stream in batches),
* the pure-Python reference's events/s on a prefix of the same stream (it is slow),
  with the native firings on that prefix checked equal to the reference's,
* their ratio,

and the native rate of the same 100 triggers without features (matching alone).

The numpy baseline computes, for *every* event, the per-item sliding count and mean
over 1 s and 5 s windows (sort by item and ts, cumsum, searchsorted): the same window
features all at once and offline, with no pattern matching, so an upper bound for a
vectorised approach rather than a like-for-like engine. The last line is one JSON object.

    python bench/stream.py            # 10 M events
    python bench/stream.py --quick    # 2 M events, within a minute
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.stream import Feature, StreamEngine, count, sliding  # noqa: E402
from runtime.stream_reference import ReferenceEngine  # noqa: E402

N_TYPES, N_ITEMS, LATENESS_MS = 20, 1000, 100
TYPES = [f"t{i}" for i in range(N_TYPES)]
FEATURES = [
    Feature("count", window=sliding(1_000)),
    Feature("mean", "dwell", sliding(5_000)),
    Feature("max", "price", count(10)),
]


def make_stream(n: int, seed: int = 7) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    base = np.arange(n, dtype=np.int64)
    ts = np.maximum(base - rng.integers(0, LATENESS_MS + 1, n), 0)
    types = rng.integers(0, N_TYPES, n, dtype=np.int32)
    keys = np.stack([rng.integers(0, N_ITEMS, n), rng.integers(0, 50, n)], axis=1)
    values = np.stack([rng.exponential(30.0, n), rng.uniform(0, 100, n)], axis=1)
    return ts, types, keys.astype(np.int64), values


def make_engine(n_triggers: int, seed: int = 11, features: bool = True) -> StreamEngine:
    rng = np.random.default_rng(seed)
    engine = StreamEngine(
        event_types=TYPES,
        key_fields=["item", "user"],
        value_fields=["dwell", "price"],
        lateness_ms=LATENESS_MS,
        max_keys=100_000,
    )
    for _ in range(n_triggers):
        steps = [TYPES[t] for t in rng.integers(0, N_TYPES, rng.integers(2, 4))]
        pattern = steps[0]
        for step in steps[1:]:
            pattern += rng.choice([" -> ", " ~> "]) + step
        if rng.random() < 0.5:
            pattern += f"[price>{int(rng.integers(0, 100))}]"
        engine.add_trigger(
            pattern, by="item", within_ms=5_000, features=FEATURES if features else []
        )
    return engine


def native_rate(
    n_triggers: int, stream: tuple[np.ndarray, ...], trials: int, features: bool = True
) -> tuple[float, int]:
    best, firings, n = 0.0, 0, len(stream[0])
    batch = 1 << 16
    for _ in range(trials):
        engine = make_engine(n_triggers, features=features)
        start = time.perf_counter()
        fired = 0
        for lo in range(0, n, batch):
            fired += len(engine.push_batch(*(a[lo : lo + batch] for a in stream)))
        best = max(best, n / (time.perf_counter() - start))
        firings = fired
    return best, firings


def python_rate(n_triggers: int, stream: tuple[np.ndarray, ...], n: int) -> float:
    native = make_engine(n_triggers)
    reference = ReferenceEngine(native.config)
    for spec in native.triggers:
        reference.add_trigger(spec)
    prefix = [a[:n] for a in stream]
    start = time.perf_counter()
    expected = reference.push_batch(*prefix)
    rate = n / (time.perf_counter() - start)
    got = native.push_batch(*prefix)
    assert np.array_equal(got.event_index, expected.event_index), "native != reference"
    assert np.array_equal(got.trigger_id, expected.trigger_id), "native != reference"
    for tid in got.fired_triggers:
        assert np.allclose(got.features(tid), expected.features(tid), equal_nan=True)
    return rate


def numpy_rate(stream: tuple[np.ndarray, ...], trials: int) -> float:
    ts, _, keys, values = stream
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        order = np.lexsort((ts, keys[:, 0]))
        combined = keys[order, 0] * (1 << 40) + ts[order]
        sums = np.concatenate([[0.0], np.cumsum(values[order, 0])])
        hi = np.searchsorted(combined, combined, side="right")
        for window in (1_000, 5_000):
            lo = np.searchsorted(combined, combined - window + 1, side="left")
            n_in = hi - lo
            mean = (sums[hi] - sums[lo]) / n_in
        assert mean.shape == n_in.shape
        best = max(best, len(ts) / (time.perf_counter() - start))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 M events, within a minute")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core
    n = 2_000_000 if args.quick else 10_000_000
    trials = 3
    stream = make_stream(n)
    results: dict[str, float | int | str] = {"events": n, "cpu_cores_used": 1}
    results["numpy_events_per_s"] = round(numpy_rate(stream, trials))
    print(f"stream: {n:,} events, {N_TYPES} types, {N_ITEMS} items, lateness {LATENESS_MS} ms")
    print(
        f"numpy baseline (sliding count+mean, 2 windows, no patterns): "
        f"{results['numpy_events_per_s']:,} events/s"
    )
    python_events = {1: 20_000, 100: 5_000, 1000: 1_000}
    for n_triggers in (1, 100, 1000):
        rate, fired = native_rate(n_triggers, stream, trials)
        py = python_rate(n_triggers, stream, python_events[n_triggers])
        results[f"native_events_per_s_{n_triggers}"] = round(rate)
        results[f"python_events_per_s_{n_triggers}"] = round(py)
        results[f"ratio_vs_python_{n_triggers}"] = round(rate / py, 1)
        results[f"ratio_vs_numpy_{n_triggers}"] = round(rate / results["numpy_events_per_s"], 2)
        results[f"firings_per_event_{n_triggers}"] = round(fired / n, 4)
        print(
            f"{n_triggers:>5} triggers: native {rate:>13,.0f} events/s "
            f"({fired / n:.3f} firings/event) | python reference {py:>9,.0f} events/s "
            f"(first {python_events[n_triggers]:,} events, firings checked equal) | "
            f"x{rate / py:,.0f}"
        )
    # The same 100 triggers without features: what pattern matching alone costs.
    rate, _ = native_rate(100, stream, trials, features=False)
    results["native_events_per_s_100_match_only"] = round(rate)
    print(f"  100 triggers, no features (matching only): native {rate:,.0f} events/s")
    command = "python bench/stream.py" + (" --quick" if args.quick else "")
    results["command"] = command
    print(f"reproduce (repo root, project venv): {command}")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
