"""Throughput of the native stream engine next to what a user would write instead.

One synthetic app stream (20 event types, 1000 items, two value fields, one event per
ms with out-of-order arrivals inside a 100 ms lateness) is pushed through engines with
1, 100 and 1000 registered triggers (2-3 step patterns, mixed `->`/`~>`, conditions,
a 5 s span; each with count/sliding(1 s), mean/sliding(5 s) and max/count(10)
features), pinned to one core. Reported:

* native events/s per trigger count, in large batches (best of a few trials);
* the best plain-Python implementation of the same work (bench/_stream_baselines.py:
  dispatch by event type, precomputed constants, per-key deques) and the vectorised
  numpy one (1 trigger, offline), each checked to give the native firings first:
  `ratio_vs_best_python_{1,100}`, `ratio_vs_numpy_1`; the pure-Python reference
  (`runtime.stream_reference`, every trigger on every event) as `ratio_vs_reference_*`;
* small batches (1, 16 and 256 events a push, 100 triggers) and the cost of a
  one-event push at 1, 100 and 1000 triggers, next to the binding's own call;
* one busy key firing on every event with long windows (mean over sliding 1 s and
  60 s, count(1000)): the cost of a firing must not grow with the window.

The last line is one JSON object.

    python bench/stream.py            # 10 M events
    python bench/stream.py --quick    # 2 M events, within a minute or two
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

from bench._stream_baselines import BestPython, numpy_firings  # noqa: E402
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


def best_python_rate(n_triggers: int, stream: tuple[np.ndarray, ...], n: int) -> float:
    native = make_engine(n_triggers)
    baseline = BestPython(native)
    ts, types, keys, values = (a[:n].tolist() for a in stream)
    start = time.perf_counter()
    rows = baseline.push(ts, types, keys, values)
    rate = n / (time.perf_counter() - start)
    got = native.push_batch(*(a[:n] for a in stream))
    firings = list(zip(got.event_index, got.trigger_id, strict=True))
    assert [(i, t) for i, t, _ in rows] == firings, "best Python's firings differ"
    want = np.array([got.feature_row(i) for i in range(len(got))]).reshape(-1, 3)
    assert np.allclose(np.array([r for _, _, r in rows]).reshape(-1, 3), want, rtol=1e-12)
    return rate


def numpy_rate(stream: tuple[np.ndarray, ...], trials: int) -> float:
    engine = make_engine(1)
    got = engine.push_batch(*stream)
    best = 0.0
    for _ in range(trials):
        start = time.perf_counter()
        index, features = numpy_firings(engine.triggers[0], stream, LATENESS_MS)
        best = max(best, len(stream[0]) / (time.perf_counter() - start))
    assert np.array_equal(index, got.event_index), "numpy firings differ from the engine's"
    # numpy's window sums are differences of prefix sums: close, not exact.
    assert np.allclose(features, got.features(0), rtol=1e-6), "numpy features differ"
    return best


def small_batch_rate(n_triggers: int, stream: tuple[np.ndarray, ...], size: int, n: int) -> float:
    """Events/s pushing `size` events per call (after a warm-up of large batches)."""
    engine = make_engine(n_triggers)
    warm = 200_000
    engine.push_batch(*(a[:warm] for a in stream))
    pieces = [tuple(a[lo : lo + size] for a in stream) for lo in range(warm, warm + n, size)]
    start = time.perf_counter()
    for piece in pieces:
        engine.push_batch(*piece)
    return len(pieces) * size / (time.perf_counter() - start)


def push_cost_us(n_triggers: int, stream: tuple[np.ndarray, ...], n: int) -> tuple[float, float]:
    """Microseconds per one-event push: through the facade, and the binding alone."""
    engine = make_engine(n_triggers)
    warm = 200_000
    engine.push_batch(*(a[:warm] for a in stream))
    singles = [tuple(a[i : i + 1] for a in stream) for i in range(warm, warm + 2 * n)]
    start = time.perf_counter()
    for piece in singles[:n]:
        engine.push_batch(*piece)
    facade = (time.perf_counter() - start) / n
    native = engine._native  # what the C++ side costs for one event, binding included
    start = time.perf_counter()
    for piece in singles[n:]:
        native.push_batch(*piece)
    return facade * 1e6, (time.perf_counter() - start) / n * 1e6


def busy_key_rate(window: object, n: int) -> float:
    """One key, a trigger firing on every event, one mean over `window`: events/s."""
    engine = StreamEngine(event_types=["a"], key_fields=["k"], value_fields=["v"], lateness_ms=50)
    engine.add_trigger("a", by="k", features=[Feature("mean", "v", window)])  # type: ignore[arg-type]
    rng = np.random.default_rng(3)
    ts = np.maximum(np.arange(n, dtype=np.int64) - rng.integers(0, 51, n), 0)
    arrays = (ts, np.zeros(n, np.int32), np.zeros((n, 1), np.int64), rng.random((n, 1)))
    warm = n // 2  # fill the windows first: a 60 s window holds 60,000 events
    engine.push_batch(*(a[:warm] for a in arrays))
    start = time.perf_counter()
    fired = 0
    for lo in range(warm, n, 1 << 14):
        fired += len(engine.push_batch(*(a[lo : lo + (1 << 14)] for a in arrays)))
    assert fired == n - warm
    return (n - warm) / (time.perf_counter() - start)


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
    print(f"stream: {n:,} events, {N_TYPES} types, {N_ITEMS} items, lateness {LATENESS_MS} ms")
    results["numpy_events_per_s_1"] = round(numpy_rate(stream, trials))
    reference_events = {1: 20_000, 100: 5_000, 1000: 1_000}
    best_python_events = {1: 200_000, 100: 100_000 if args.quick else 300_000}
    for n_triggers in (1, 100, 1000):
        rate, fired = native_rate(n_triggers, stream, trials)
        ref = python_rate(n_triggers, stream, reference_events[n_triggers])
        results[f"native_events_per_s_{n_triggers}"] = round(rate)
        results[f"reference_events_per_s_{n_triggers}"] = round(ref)
        results[f"ratio_vs_reference_{n_triggers}"] = round(rate / ref, 1)
        results[f"firings_per_event_{n_triggers}"] = round(fired / n, 4)
        line = f"{n_triggers:>5} triggers: native {rate:>13,.0f} events/s"
        line += f" ({fired / n:.3f} firings/event)"
        if n_triggers in best_python_events:
            py = best_python_rate(n_triggers, stream, best_python_events[n_triggers])
            results[f"best_python_events_per_s_{n_triggers}"] = round(py)
            results[f"ratio_vs_best_python_{n_triggers}"] = round(rate / py, 1)
            line += f" | best Python {py:,.0f} events/s (x{rate / py:,.1f})"
        if n_triggers == 1:
            numpy = results["numpy_events_per_s_1"]
            results["ratio_vs_numpy_1"] = round(rate / float(numpy), 2)
            line += f" | numpy {numpy:,} events/s (x{rate / float(numpy):.2f})"
        line += f" | reference {ref:,.0f} events/s (x{rate / ref:,.0f}); firings checked equal"
        print(line)
    rate, _ = native_rate(100, stream, trials, features=False)
    results["native_events_per_s_100_match_only"] = round(rate)
    print(f"  100 triggers, no features (matching only): native {rate:,.0f} events/s")
    small = 20_000 if args.quick else 100_000
    for size in (1, 16, 256):
        rate = small_batch_rate(100, stream, size, small * (1 if size == 1 else 10))
        results[f"native_events_per_s_100_batch_{size}"] = round(rate)
        print(f"  100 triggers, {size:>3} events a push: {rate:,.0f} events/s")
    for n_triggers in (1, 100, 1000):
        facade, native = push_cost_us(n_triggers, stream, small)
        results[f"push_one_event_us_{n_triggers}"] = round(facade, 2)
        results[f"push_one_event_native_call_us_{n_triggers}"] = round(native, 2)
        print(f"  one-event push, {n_triggers:>4} triggers: {facade:.1f} us", end="")
        print(f" (binding alone {native:.1f} us)")
    results["push_one_event_ratio_1000_vs_1_triggers"] = round(
        float(results["push_one_event_us_1000"]) / float(results["push_one_event_us_1"]), 2
    )
    native_call = float(results["push_one_event_native_call_us_100"])
    results["push_one_event_ratio_vs_native_call_100"] = round(
        float(results["push_one_event_us_100"]) / native_call, 2
    )
    busy = 200_000 if args.quick else 400_000
    for name, window in (
        ("sliding_1s", sliding(1_000)),
        ("sliding_60s", sliding(60_000)),
        ("count_1000", count(1_000)),
        ("count_10", count(10)),
    ):
        rate = busy_key_rate(window, busy)
        results[f"busy_key_events_per_s_{name}"] = round(rate)
        print(f"  one busy key firing a mean over {name}: {rate:,.0f} events/s")
    results["busy_key_ratio_60s_vs_1s"] = round(
        float(results["busy_key_events_per_s_sliding_60s"])
        / float(results["busy_key_events_per_s_sliding_1s"]),
        2,
    )
    command = "python bench/stream.py" + (" --quick" if args.quick else "")
    results["command"] = command
    print(f"reproduce (repo root, project venv): {command}")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
