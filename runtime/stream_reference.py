"""Pure-Python reference of the stream engine: the semantics of `runtime.stream`, literally.

It shares nothing with the native engine but the parsed specification
(`runtime.stream_spec`): each trigger is matched on its own (no trie), windows are
list comprehensions over the key's events, and aggregations are written out. The
property tests check the native engine against it; the benchmark times it.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from runtime.stream_batch import Firings, check_batch
from runtime.stream_spec import (
    AGGREGATIONS,
    CMP_OPS,
    CONTIGUOUS,
    MAX_TS,
    CompiledFeature,
    EngineConfig,
    EngineStateError,
    LateEventError,
    NonFiniteValueError,
    Step,
    TimestampRangeError,
    TriggerSpec,
    UnknownEventTypeError,
)

__all__ = ["ReferenceEngine"]

_Event = tuple[int, int, tuple[float, ...]]  # (ts, type, values)
_COMPARE = dict(
    zip(
        range(len(CMP_OPS)),
        (
            lambda a, b: a == b,
            lambda a, b: a != b,
            lambda a, b: a < b,
            lambda a, b: a <= b,
            lambda a, b: a > b,
            lambda a, b: a >= b,
        ),
        strict=True,
    )
)


@dataclass
class _Partition:
    last_activity: int
    events: list[_Event] = field(default_factory=list)
    type_counts: Counter[int] = field(default_factory=Counter)
    # Per trigger: best start ts of a match of steps[:j+1] ending at any event so far
    # (`any`), and ending exactly at the partition's latest event (`last`).
    any: dict[int, list[int | None]] = field(default_factory=dict)
    last: dict[int, list[int | None]] = field(default_factory=dict)


class ReferenceEngine:
    """Same constructor inputs and push semantics as `StreamEngine`, in plain Python."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.triggers: list[TriggerSpec] = []
        self.watermark: int | None = None
        self._parts: OrderedDict[tuple[int, int], _Partition] = OrderedDict()  # LRU first
        self._frozen = False

    def add_trigger(self, spec: TriggerSpec) -> None:
        """Register a compiled trigger; only before the first push."""
        if self._frozen:
            raise EngineStateError("triggers must be added before the first push")
        self.triggers.append(spec)

    def push_batch(self, ts: object, types: object, keys: object, values: object) -> Firings:
        """Validate the whole batch, then apply it event by event."""
        cfg = self.config
        ts_a, types_a, keys_a, values_a = check_batch(
            ts, types, keys, values, len(cfg.key_fields), len(cfg.value_fields)
        )
        self._frozen = True
        self._validate(ts_a.tolist(), types_a.tolist(), values_a.tolist())
        rows: list[tuple[int, int, int, int, int, int, list[float]]] = []
        for i, (t, typ, k, v) in enumerate(
            zip(ts_a.tolist(), types_a.tolist(), keys_a.tolist(), values_a.tolist(), strict=True)
        ):
            rows.extend(self._apply(i, t, typ, k, tuple(v)))
        return self._firings(rows)

    def _validate(self, ts: list[int], types: list[int], values: list[list[float]]) -> None:
        cfg, wm = self.config, self.watermark
        for i, (t, typ, vals) in enumerate(zip(ts, types, values, strict=True)):
            if not 0 <= typ < len(cfg.event_types):
                raise UnknownEventTypeError(
                    f"event {i}: type code {typ} is not one of the "
                    f"{len(cfg.event_types)} event types",
                    i,
                )
            if not 0 <= t <= MAX_TS:
                raise TimestampRangeError(f"event {i}: timestamp {t} is outside [0, 2**62]", i)
            for name, v in zip(cfg.value_fields, vals, strict=True):
                if not math.isfinite(v):
                    raise NonFiniteValueError(
                        f"event {i}: value {name!r} is {v} (values must be finite)", i
                    )
            if wm is not None and t < wm - cfg.lateness_ms:
                raise LateEventError(
                    f"event {i}: timestamp {t} is {wm - t} ms behind the watermark {wm}, "
                    f"beyond the allowed lateness of {cfg.lateness_ms} ms",
                    i,
                )
            wm = t if wm is None else max(wm, t)

    def _apply(
        self, index: int, t: int, typ: int, keys: list[int], values: tuple[float, ...]
    ) -> list[tuple[int, int, int, int, int, int, list[float]]]:
        cfg = self.config
        wm = self.watermark = t if self.watermark is None else max(self.watermark, t)
        if cfg.key_ttl_ms >= 0:
            while self._parts and next(iter(self._parts.values())).last_activity < (
                wm - cfg.key_ttl_ms
            ):
                self._parts.popitem(last=False)
        fired = []
        for by in sorted({trig.by for trig in self.triggers}):
            group = [trig for trig in self.triggers if trig.by == by]
            part = self._partition(by, keys[by], wm)
            part.events.append((t, typ, values))
            part.type_counts[typ] += 1
            self._prune(part, group, wm)
            for trig in group:
                start = self._match(part, trig, typ, keys, values, t)
                if start is not None and (trig.within_ms < 0 or start >= t - trig.within_ms):
                    lo, hi, vector = self._features(part, trig, t)
                    fired.append((trig.id, keys[by], t, index, lo, hi, vector))
        return sorted(fired, key=lambda row: row[0])

    def _partition(self, by: int, key: int, wm: int) -> _Partition:
        part = self._parts.get((by, key))
        if part is None:
            part = self._parts[(by, key)] = _Partition(wm)
            if len(self._parts) > self.config.max_keys:
                self._parts.popitem(last=False)
        self._parts.move_to_end((by, key))
        part.last_activity = wm
        return part

    def _prune(self, part: _Partition, group: list[TriggerSpec], wm: int) -> None:
        """Drop events no window can reach again (an optimisation, not semantics).

        An event can go once it is older than every time window can look back from any
        future firing (ts < watermark - lateness - reach) and newer events fill every
        count window it could still be part of.
        """
        feats = [f for trig in group for f in trig.features]
        reach = [f.reach_ms for f in feats if f.window_kind != 2]
        horizon = wm - self.config.lateness_ms - max(reach) if reach else math.inf
        counts = [(f.of, f.window_size) for f in feats if f.window_kind == 2]
        drop = 0
        for ts, typ, _ in part.events:
            total = len(part.events) - drop
            held = any(
                (of < 0 and total <= n) or (of == typ and part.type_counts[typ] <= n)
                for of, n in counts
            )
            if ts >= horizon or held:
                break
            part.type_counts[typ] -= 1
            drop += 1
        del part.events[:drop]

    def _match(
        self,
        part: _Partition,
        trig: TriggerSpec,
        typ: int,
        keys: list[int],
        values: tuple[float, ...],
        t: int,
    ) -> int | None:
        """Advance the trigger's match state; return the best start of a match ending here."""
        n = len(trig.steps)
        best_any = part.any.setdefault(trig.id, [None] * n)
        prev_last = part.last.get(trig.id, [None] * n)
        new_last: list[int | None] = [None] * n
        for j, step in enumerate(trig.steps):
            if not _step_matches(step, typ, keys, values):
                continue
            if j == 0:
                new_last[j] = t
            else:
                new_last[j] = (prev_last if step.op == CONTIGUOUS else best_any)[j - 1]
        for j, start in enumerate(new_last):
            if start is not None and (best_any[j] is None or start > best_any[j]):
                best_any[j] = start
        part.last[trig.id] = new_last
        return new_last[-1]

    def _features(
        self, part: _Partition, trig: TriggerSpec, t: int
    ) -> tuple[int, int, list[float]]:
        vector: list[float] = []
        bounds: list[tuple[int, int]] = []
        for feat in trig.features:
            pool = [e for e in part.events if feat.of < 0 or e[1] == feat.of]
            size = feat.window_size
            if feat.window_kind == 0:
                bounds.append((t - size + 1, t + 1))
                window = [e for e in pool if t - size < e[0] <= t]
            elif feat.window_kind == 1:
                b = t // size * size
                bounds.append((b - size, b))
                window = [e for e in pool if b - size <= e[0] < b]
            else:
                window = pool[-size:]
                if window:
                    bounds.append((min(e[0] for e in window), max(e[0] for e in window) + 1))
            vector.extend(_aggregate(feat, window))
        if not bounds:
            return t, t + 1, vector
        return min(lo for lo, _ in bounds), max(hi for _, hi in bounds), vector

    def _firings(self, rows: list[tuple[int, int, int, int, int, int, list[float]]]) -> Firings:
        per_trigger: dict[int, list[list[float]]] = {}
        row_index = []
        for row in rows:
            matrix = per_trigger.setdefault(row[0], [])
            row_index.append(len(matrix))
            matrix.append(row[6])
        names = ("trigger_id", "key", "ts", "event_index", "window_start", "window_end")
        columns: dict[str, NDArray[np.int64] | NDArray[np.int32]] = {
            name: np.array([r[j] for r in rows], dtype=np.int32 if j == 0 else np.int64)
            for j, name in enumerate(names)
        }
        columns["row"] = np.array(row_index, dtype=np.int64)
        widths = [trig.width for trig in self.triggers]
        features = {
            tid: np.array(m, dtype=np.float64).reshape(len(m), widths[tid])
            for tid, m in per_trigger.items()
        }
        return Firings(columns, features, widths)


def _step_matches(step: Step, typ: int, keys: Sequence[int], values: Sequence[float]) -> bool:
    if step.type != typ:
        return False
    return all(
        _COMPARE[c.cmp]((values if c.on_value else keys)[c.field], c.literal)
        for c in step.conditions
    )


def _aggregate(feat: CompiledFeature, window: list[_Event]) -> list[float]:
    """One feature over a window's events (arrival order); empty rules in `runtime.stream`."""
    agg = AGGREGATIONS[feat.agg]
    xs = [e[2][feat.field] for e in window] if feat.field >= 0 else []
    if agg == "count":
        return [float(len(window))]
    if agg == "sum":
        return [math.fsum(xs)]
    if agg == "distinct":
        return [float(len(set(xs)))]
    if agg == "histogram":
        edges = feat.edges
        counts = [0.0] * (len(edges) - 1)
        for x in xs:
            if edges[0] <= x <= edges[-1]:
                counts[min(_bin(edges, x), len(counts) - 1)] += 1.0
        return counts
    if not xs:
        return [math.nan]
    if agg == "mean":
        return [math.fsum(xs) / len(xs)]
    if agg == "min":
        return [min(xs)]
    if agg == "max":
        return [max(xs)]
    if agg == "std":
        return [_exact_std(xs)]
    # last: greatest ts, ties broken by latest arrival
    best = max(range(len(window)), key=lambda j: (window[j][0], j))
    return [xs[best]]


def _exact_std(xs: list[float]) -> float:
    """Return the population std from the exact variance (n*sum(x^2) - sum(x)^2) / n^2.

    In integers: every float is an integer over a power of two, so scaling them all to the largest
    denominator makes the variance an exact ratio of integers; Python's int / int is
    correctly rounded, so only the final square root rounds again.
    """
    ratios = [x.as_integer_ratio() for x in xs]
    scale = max(d for _, d in ratios)
    ints = [num * (scale // d) for num, d in ratios]
    n = len(ints)
    numerator = n * sum(i * i for i in ints) - sum(ints) ** 2
    return math.sqrt(numerator / (n * n * scale * scale))


def _bin(edges: tuple[float, ...], x: float) -> int:
    """Index of the bin [edges[i], edges[i+1]) holding x (x within the edges)."""
    lo, hi = 0, len(edges) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if edges[mid] <= x:
            lo = mid
        else:
            hi = mid
    return lo
