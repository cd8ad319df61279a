"""What a user would write instead of the native stream engine, for bench/stream.py.

Both compute the benchmark's exact workload (its triggers and its three features:
count over sliding(1 s), mean of dwell over sliding(5 s), max of price over count(10),
on a stream out of order within the lateness) and are checked against the engine's
firings before they are timed.

* `BestPython`: plain Python done well. Events are dispatched by type to the trigger
  steps that can use them (instead of every trigger looking at every event); pattern
  constants are precomputed; each key keeps a deque of its recent events, scanned from
  the newest with the lateness stop rule (a key holds a handful of events per window
  here, so a scan beats keeping running aggregates in Python).
* `numpy_firings`: one trigger, vectorised over the whole stream: matches as shifted
  and segmented-cumulative-max arrays over the key-sorted stream, windows by
  searchsorted over (key, ts) with prefix sums, minus the late arrivals that had not
  arrived yet at the firing event. It needs the whole stream up front (offline).
"""

from __future__ import annotations

import math
import operator
from collections import deque
from typing import Any

import numpy as np

from runtime.stream import StreamEngine
from runtime.stream_spec import CMP_OPS, CONTIGUOUS, TriggerSpec

_CMP = dict(
    zip(
        range(len(CMP_OPS)),
        (operator.eq, operator.ne, operator.lt, operator.le, operator.gt, operator.ge),
        strict=True,
    )
)


def _check_workload(engine: StreamEngine) -> None:
    names = [[f.name for f in t.features] for t in engine.triggers]
    expected = ["count()@sliding(1000ms)", "mean(dwell)@sliding(5000ms)", "max(price)@count(10)"]
    if any(n != expected for n in names) or any(t.by != 0 for t in engine.triggers):
        raise ValueError("the baselines implement the benchmark's features only")


class BestPython:
    """The benchmark's triggers in plain Python (see the module docstring)."""

    def __init__(self, engine: StreamEngine) -> None:
        _check_workload(engine)
        self.lateness = engine.config.lateness_ms
        # by_type[type] = [(trigger, step index, op, conditions)], conditions precomputed.
        self.by_type: dict[int, list[tuple[int, int, int, list[Any]]]] = {}
        self.steps = [len(t.steps) for t in engine.triggers]
        self.within = [t.within_ms for t in engine.triggers]
        for t in engine.triggers:
            for j, step in enumerate(t.steps):
                conds = [(c.on_value, c.field, _CMP[c.cmp], c.literal) for c in step.conditions]
                self.by_type.setdefault(step.type, []).append((t.id, j, step.op, conds))
        self.keys: dict[int, list[Any]] = {}  # key -> [events deque, seq, per-trigger state]
        self.watermark = -1

    def push(
        self, ts: list[int], types: list[int], keys: list[list[int]], values: list[list[float]]
    ) -> list[tuple[int, int, list[float]]]:
        """Return [(event index, trigger id, [count, mean, max])] in engine order."""
        out = []
        for i, (t, typ, k, v) in enumerate(zip(ts, types, keys, values, strict=True)):
            self.watermark = max(self.watermark, t)
            state = self.keys.get(k[0])
            if state is None:
                state = self.keys[k[0]] = [deque(), 0, {}]
            events, seq, triggers = state
            events.append((t, v[0], v[1]))
            horizon = self.watermark - self.lateness - 5_000
            while len(events) > 10 and events[0][0] < horizon:
                events.popleft()
            state[1] = seq + 1
            fired = self._match(self.by_type.get(typ, ()), triggers, seq, t, k, v)
            if fired:
                row = self._features(events, t)
                out.extend((i, tid, row) for tid in sorted(fired))
        return out

    def _match(self, steps, triggers, seq, t, k, v) -> list[int]:
        # A trigger's `last` is valid only if it was set at the key's previous event.
        updates, fired = [], []
        for tid, j, op, conds in steps:
            if not all(f(v[fi] if on_v else k[fi], lit) for on_v, fi, f, lit in conds):
                continue
            st = triggers.get(tid)
            if j == 0:
                start = t
            elif st is None:
                continue
            elif op == CONTIGUOUS:
                start = st[1][j - 1] if st[2] == seq - 1 else None
            else:
                start = st[0][j - 1]
            if start is not None:
                updates.append((tid, j, start))
        for tid in {u[0] for u in updates}:
            st = triggers.get(tid)
            if st is None:
                st = triggers[tid] = [[None] * self.steps[tid], [None] * self.steps[tid], -2]
            if st[2] != seq:
                st[1] = [None] * self.steps[tid]
                st[2] = seq
        for tid, j, start in updates:
            st = triggers[tid]
            st[1][j] = start
            if st[0][j] is None or start > st[0][j]:
                st[0][j] = start
            within = self.within[tid]
            if j == self.steps[tid] - 1 and (within < 0 or start >= t - within):
                fired.append(tid)
        return fired

    def _features(self, events: deque, t: int) -> list[float]:
        n1, dwell, stop = 0, [], t - 5_000 + 1 - self.lateness
        for ts, d, _ in reversed(events):
            if ts < stop:
                break
            if t - 5_000 < ts <= t:
                dwell.append(d)
                n1 += t - 1_000 < ts
        prices = [e[2] for e in list(events)[-10:]]
        return [float(n1), math.fsum(dwell) / len(dwell), max(prices)]


def numpy_firings(spec: TriggerSpec, stream: tuple[np.ndarray, ...], lateness: int):
    """Return (event index, features[n, 3]) of one benchmark trigger, vectorised."""
    ts, types, keys, values = stream
    order = np.argsort(keys[:, 0], kind="stable")  # key-major, arrival order within a key
    k_ts, k_type, k_item, k_vals = ts[order], types[order], keys[order, 0], values[order]
    n = len(ts)
    first = np.ones(n, bool)
    first[1:] = k_item[1:] != k_item[:-1]
    seg = np.cumsum(first) - 1
    big = np.int64(1 << 42)
    prev = None
    for j, step in enumerate(spec.steps):
        match = k_type == step.type
        for c in spec.steps[j].conditions:
            column = k_vals[:, c.field] if c.on_value else keys[order, c.field]
            match &= _CMP[c.cmp](column, c.literal)
        if j == 0:
            start = k_ts
        elif step.op == CONTIGUOUS:
            start = np.concatenate([[-1], prev[:-1]])
        else:  # best start of a match ending strictly before, within the key
            best = np.maximum.accumulate(prev + seg * big) - seg * big
            start = np.concatenate([[-1], best[:-1]])
        if j:
            start = np.where(first, -1, start)
        prev = np.where(match, start, -1)
    fire = prev >= 0
    if spec.within_ms >= 0:
        fire &= prev >= k_ts - spec.within_ms
    f = np.flatnonzero(fire)
    t = k_ts[f]
    # Windows over all of the key's events by ts, then minus those arriving later.
    by_ts = np.lexsort((ts, keys[:, 0]))
    combined = keys[by_ts, 0] * big + ts[by_ts]
    dwell_sums = np.concatenate([[0.0], np.cumsum(values[by_ts, 0])])
    base = k_item[f] * big
    hi = np.searchsorted(combined, base + t, side="right")
    lo1 = np.searchsorted(combined, base + t - 1_000, side="right")
    lo5 = np.searchsorted(combined, base + t - 5_000, side="right")
    count1, count5 = (hi - lo1).astype(np.float64), (hi - lo5).astype(np.float64)
    dwell = dwell_sums[hi] - dwell_sums[lo5]
    wm_before = np.concatenate([[-1], np.maximum.accumulate(ts)[:-1]])[order]
    active = np.ones(len(f), bool)
    for k in range(1, n):
        q = f + k
        active &= q < n
        qa = np.where(active, q, 0)
        active &= (seg[qa] == seg[f]) & (wm_before[qa] <= t + lateness)
        if not active.any():
            break
        late = active & (k_ts[qa] <= t)  # arrived after the firing: not in its windows
        count1 -= late & (k_ts[qa] > t - 1_000)
        count5 -= late
        dwell -= np.where(late, k_vals[qa, 0], 0.0)
    price = np.full(len(f), -np.inf)
    for k in range(10):
        q = f - k
        ok = (q >= 0) & (seg[np.maximum(q, 0)] == seg[f])
        price = np.where(ok, np.maximum(price, k_vals[np.maximum(q, 0), 1]), price)
    features = np.stack([count1, dwell / count5, price], axis=1)
    index = order[f]
    sort = np.argsort(index, kind="stable")
    return index[sort], features[sort]
