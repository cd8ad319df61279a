"""On-device stream processing: raw events in, model-ready feature vectors out.

The app pushes events; ML tasks register triggers; when a trigger fires, the engine
returns the features computed over its windows. The C++ core (`runtime._native`) does
the work; `runtime.stream_reference` implements the same semantics in plain Python.

Semantics
---------
**Events.** An event is `(ts, type, keys, values)`: `ts` int64 milliseconds in
[0, 2**62], `type` one of the engine's event types (an int32 code: its index in
`event_types`), `keys` one int64 per key field, `values` one finite float64 per value
field. Events are applied in *arrival* order (batch order, batch after batch).

**Watermark and lateness.** The watermark is the largest ts applied so far. An event
with ts < watermark - lateness_ms is late beyond lateness: the batch holding it is
rejected whole. Earlier ts within lateness are fine (out of order).

**Partitions.** Each trigger partitions events by one key field (`by`). A key's
*stream* is every event (of any type) whose `by` field equals that key, in arrival order.

**Patterns.** `"page_enter[page==3] -> click ~> purchase[amount>10, n>=2]"`: steps are
event types with optional conditions (`field op literal`, op one of == != < <= > >=,
all must hold; key fields compare as int64 with integer literals, value fields as
float64). Between steps, `->` means the next step is the *very next* event of the key's
stream, `~>` means any number of the key's events may come between. A trigger fires at
event e (at most once per trigger and event) iff there are events e_1, ..., e_n = e of
e's key stream at arrival positions p_1 < ... < p_n with e_i satisfying step i,
p_(i+1) = p_i + 1 where step i+1 follows `->`, and, if `within_ms` is set,
ts(e_1) >= ts(e) - within_ms. A one-step pattern is a plain condition trigger.

**Windows** (over the firing key's stream, `of=` restricts to one event type; `t` is
the firing event's ts; only events arrived so far count, the firing event included):
`sliding(ms)`: ts in (t - ms, t]. `tumbling(ms)`: the last complete bucket
[b - ms, b) with b = floor(t / ms) * ms (late events still arriving count).
`count(n)`: the last n events in arrival order.

**Aggregations** of one value field: count, sum, mean, min, max, std (population),
last (value of the greatest ts, ties to the latest arrival), distinct (number of
distinct values; -0.0 == 0.0), histogram(edges) (len(edges) - 1 counts, numpy's bins:
[e_i, e_i+1), the last one closed; values outside are not counted). An empty window
gives 0 for count, sum, distinct and histogram bins and NaN for the others.
`sum` is the exact sum of the window's values rounded once (Python's `math.fsum`):
the engine keeps compensated running sums whose lost bits it bounds, and sums the
window exactly whenever that bound exceeds 2**-40 of the result, so a sum is exactly
rounded in the common case and always within 2**-40 relative. `mean` is that sum / n;
`std` is the square root of the exactly computed variance (same guarantee). Windows
keep running aggregates (monotonic queues for min and max), so a firing's cost does
not grow with its window's length (distinct counts excepted).

**Output.** Per firing: trigger id, key, ts, the firing event's index in its batch,
window bounds `[window_start, window_end)` = the hull of the trigger's windows
(sliding: [t - ms + 1, t + 1), tumbling: [b - ms, b), count: [min ts, max ts + 1) of
its events; [t, t + 1) when none contributes), and its feature row. Firings come in
(event index, trigger id) order; features are one float64 matrix per trigger (a
zero-copy view of the native engine's buffer).

**Memory.** State is per (partition field, key). A key's state is dropped (as if the
key were new) when it has been idle for more than `key_ttl_ms` of watermark, or when a
new key would exceed `max_keys` (least recently used first). Within a key, events are
kept only while a window can still see them: ts >= watermark - lateness - reach
(reach = the largest sliding size or twice the largest tumbling size) or among the last
n of a count window; logs are trimmed when they have doubled since their last trim. So
memory is O(max_keys * (trie nodes + events per key within reach + lateness + largest
count window)), at most twice the events a window can still see.

**Changing triggers.** Triggers are compiled into one trie per partition field (shared
prefixes share state). A trigger can be added at any time: added after the first push,
it starts with fresh state (it sees the events pushed from then on), in its own tries
and key state, so every other trigger keeps its windows and partial matches; its keys
count towards `max_keys` like any other (state is per trigger group and key). A removed
trigger stops firing at once; its id is never reused, and its state goes when no live
trigger shares it.

**Snapshots.** `snapshot()` returns the engine's state as bytes: every key's logs and
partial matches, the watermark and counters (window aggregates are rebuilt from the logs
when first read). `restore(data)` is an instance method: build the engine as before
(same constructor arguments, the same `add_trigger` calls in the same order, the same
`remove_trigger` calls) and restore into it; it then fires exactly as the engine that
took the snapshot would have (sums within the same 2**-40 guarantee). The bytes are
versioned and checksummed (`runtime.stream_snapshot`): anything else raises
`SnapshotError`, a snapshot of another configuration or trigger set
`SnapshotMismatchError` naming what differs, and the engine is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

import numpy as np
from numpy.typing import NDArray

from runtime._native import _core
from runtime.stream_batch import Firings, check_batch
from runtime.stream_snapshot import describe, open_snapshot, seal_snapshot
from runtime.stream_spec import (
    BatchFormatError,
    EngineConfig,
    EngineStateError,
    Feature,
    LateEventError,
    NonFiniteValueError,
    PatternError,
    SnapshotError,
    SnapshotMismatchError,
    StreamInputError,
    TimestampRangeError,
    TriggerSpec,
    UnknownEventTypeError,
    UnknownFieldError,
    Window,
    count,
    sliding,
    tumbling,
)

__all__ = [
    "BatchFormatError",
    "EngineStateError",
    "Feature",
    "Firings",
    "LateEventError",
    "NonFiniteValueError",
    "PatternError",
    "SnapshotError",
    "SnapshotMismatchError",
    "StreamEngine",
    "StreamInputError",
    "StreamStats",
    "TimestampRangeError",
    "UnknownEventTypeError",
    "UnknownFieldError",
    "Window",
    "count",
    "sliding",
    "tumbling",
]


class StreamStats(TypedDict):
    """Counters and memory of a `StreamEngine` (see `StreamEngine.stats`)."""

    live_keys: int
    live_events: int
    state_bytes: int
    events: int
    firings: int
    evicted_keys: int
    watermark: int | None
    trie_nodes: int


class StreamEngine:
    """Matches trigger patterns over pushed events and returns their window features.

    Example::

        engine = StreamEngine(event_types=["page_enter", "click"], key_fields=["item"],
                              value_fields=["dwell"], lateness_ms=5_000)
        tid = engine.add_trigger("page_enter ~> click", by="item", within_ms=60_000,
                                 features=[Feature("mean", "dwell", sliding(60_000))])
        firings = engine.push_batch(ts, types, keys, values)
        x = firings.features(tid)   # (n_firings, 1) float64, ready as model input
    """

    def __init__(
        self,
        *,
        event_types: Sequence[str],
        key_fields: Sequence[str] = (),
        value_fields: Sequence[str] = (),
        lateness_ms: int = 0,
        max_keys: int = 100_000,
        key_ttl_ms: int | None = None,
    ) -> None:
        self.config = EngineConfig.create(
            event_types, key_fields, value_fields, lateness_ms, max_keys, key_ttl_ms
        )
        self._native = _core.Engine(
            n_types=len(self.config.event_types),
            n_keys=len(self.config.key_fields),
            value_names=list(self.config.value_fields),
            lateness=self.config.lateness_ms,
            max_keys=self.config.max_keys,
            ttl=self.config.key_ttl_ms,
        )
        self._triggers: list[TriggerSpec] = []
        self._widths: tuple[int, ...] = ()  # per trigger id, kept so a push is O(1) in them
        self._removed: set[int] = set()
        self._codes = {name: i for i, name in enumerate(self.config.event_types)}

    @property
    def event_types(self) -> tuple[str, ...]:
        """Event type names; an event's type code is its index here."""
        return self.config.event_types

    @property
    def triggers(self) -> tuple[TriggerSpec, ...]:
        """The registered triggers, indexed by trigger id (removed ones included)."""
        return tuple(self._triggers)

    @property
    def removed_triggers(self) -> frozenset[int]:
        """Ids of the triggers removed with `remove_trigger`."""
        return frozenset(self._removed)

    def type_code(self, name: str) -> int:
        """Return the int32 code of an event type name (raises UnknownEventTypeError)."""
        try:
            return self._codes[name]
        except KeyError:
            raise UnknownEventTypeError(f"unknown event type {name!r}") from None

    def add_trigger(
        self,
        pattern: str,
        *,
        by: str,
        features: Sequence[Feature] = (),
        within_ms: int | None = None,
    ) -> int:
        """Register a trigger and return its id; any time (see "Changing triggers")."""
        spec = self.config.compile_trigger(len(self._triggers), pattern, by, within_ms, features)
        steps = [(s.type, s.op, [_condition(c) for c in s.conditions]) for s in spec.steps]
        feats = [
            (f.agg, f.field, f.window_kind, f.window_size, f.of, list(f.edges))
            for f in spec.features
        ]
        trigger_id = self._native.add_trigger(spec.by, spec.within_ms, steps, feats)
        assert trigger_id == spec.id
        self._triggers.append(spec)
        self._widths = (*self._widths, spec.width)
        return trigger_id

    def remove_trigger(self, trigger_id: int) -> None:
        """Stop a trigger firing; the other triggers keep their state."""
        if trigger_id in self._removed:
            raise EngineStateError(f"trigger {trigger_id} was already removed")
        if not isinstance(trigger_id, int) or not 0 <= trigger_id < len(self._triggers):
            raise EngineStateError(f"no trigger {trigger_id!r} (ids 0..{len(self._triggers) - 1})")
        self._native.remove_trigger(trigger_id)
        self._removed.add(trigger_id)

    def snapshot(self) -> bytes:
        """Return the engine's state as versioned, checksummed bytes (see "Snapshots")."""
        return seal_snapshot(self._description(), self._native.snapshot())

    def restore(self, data: bytes) -> None:
        """Replace this engine's state with a snapshot's (see "Snapshots").

        Raises SnapshotError for bytes that are not an intact snapshot of this format
        version, SnapshotMismatchError (naming the differences) for a snapshot of
        another configuration or trigger set; the engine is then unchanged.
        """
        self._native.restore(open_snapshot(data, self._description()))

    def _description(self) -> str:
        return describe(self.config, self._triggers, self._removed)

    def feature_names(self, trigger_id: int) -> list[str]:
        """Column names of a trigger's feature matrix."""
        names = []
        for f in self._triggers[trigger_id].features:
            if f.width == 1:
                names.append(f.name)
            else:
                names.extend(
                    f"{f.name}[{lo:g},{hi:g})"
                    for lo, hi in zip(f.edges[:-1], f.edges[1:], strict=True)
                )
        return names

    def push_batch(
        self,
        ts: NDArray[np.int64],
        types: NDArray[np.int32],
        keys: NDArray[np.int64],
        values: NDArray[np.float64],
    ) -> Firings:
        """Push N events: ts int64[N], types int32[N], keys int64[N, K], values float64[N, V].

        The batch is checked whole before anything is applied: on any error
        (BatchFormatError, or a StreamInputError naming the first bad event) the engine
        is unchanged. The GIL is released while the batch is processed.
        """
        cfg = self.config
        arrays = check_batch(ts, types, keys, values, len(cfg.key_fields), len(cfg.value_fields))
        out: dict[str, Any] = self._native.push_batch(*arrays)
        features = out.pop("features")
        return Firings(out, features, self._widths)

    def push(
        self,
        ts: int,
        event_type: str,
        keys: Mapping[str, int] | Sequence[int] = (),
        values: Mapping[str, float] | Sequence[float] = (),
    ) -> Firings:
        """Push one event; keys and values by field name (a mapping) or in field order."""
        cfg = self.config
        key_row = _row(keys, cfg.key_fields, "key")
        value_row = _row(values, cfg.value_fields, "value")
        return self.push_batch(
            np.array([ts], dtype=np.int64),
            np.array([self.type_code(event_type)], dtype=np.int32),
            np.array([key_row], dtype=np.int64).reshape(1, len(cfg.key_fields)),
            np.array([value_row], dtype=np.float64).reshape(1, len(cfg.value_fields)),
        )

    def stats(self) -> StreamStats:
        """Live keys and events, state bytes, totals, watermark and trie size."""
        return StreamStats(**self._native.stats())


def _condition(c: Any) -> tuple[bool, int, int, float, int]:
    if c.on_value:
        return (True, c.field, c.cmp, float(c.literal), 0)
    return (False, c.field, c.cmp, 0.0, int(c.literal))


def _row(given: Mapping[str, Any] | Sequence[Any], fields: tuple[str, ...], what: str) -> list[Any]:
    if isinstance(given, Mapping):
        unknown = sorted(set(given) - set(fields))
        missing = [f for f in fields if f not in given]
        if unknown or missing:
            raise UnknownFieldError(
                f"{what} fields must be exactly {list(fields)}: "
                f"unknown {unknown}, missing {missing}"
            )
        row = [given[f] for f in fields]
    else:
        row = list(given)
        if len(row) != len(fields):
            raise UnknownFieldError(
                f"expected {len(fields)} {what} fields {list(fields)}, got {row}"
            )
    kinds = (int, np.integer) if what == "key" else (int, float, np.integer, np.floating)
    for name, x in zip(fields, row, strict=True):
        if isinstance(x, bool) or not isinstance(x, kinds):
            raise BatchFormatError(f"{what} field {name!r} must be a number, got {x!r}")
    return row
