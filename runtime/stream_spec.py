"""Declarations shared by the native stream engine and its pure-Python reference.

Errors, windows, features and the trigger-pattern parser live here so both engines
read exactly the same compiled specification: a pattern is parsed once, in Python, and
the engines only ever see validated numbers. The semantics are in `runtime.stream`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = [
    "AGGREGATIONS",
    "BatchFormatError",
    "CompiledFeature",
    "Condition",
    "EngineConfig",
    "EngineStateError",
    "Feature",
    "LateEventError",
    "NonFiniteValueError",
    "PatternError",
    "SnapshotError",
    "SnapshotMismatchError",
    "Step",
    "StreamInputError",
    "TimestampRangeError",
    "TriggerSpec",
    "UnknownEventTypeError",
    "UnknownFieldError",
    "Window",
    "count",
    "sliding",
    "tumbling",
]

# Timestamps are epoch milliseconds in [0, MAX_TS]; the headroom keeps every window
# bound (ts - size, ts + 1, watermark - lateness - reach) inside int64.
MAX_TS = 1 << 62
MAX_WINDOW_MS = 1 << 40
MAX_COUNT = 1 << 20
MAX_EDGES = 1025


class StreamInputError(ValueError):
    """An event in a pushed batch is invalid; the whole batch was rejected.

    `index` is the position of the first offending event in the batch.
    """

    def __init__(self, message: str, index: int = -1) -> None:
        super().__init__(message)
        self.index = index


class UnknownEventTypeError(StreamInputError):
    """An event's type code or name is not one of the engine's event types."""


class NonFiniteValueError(StreamInputError):
    """An event carries a NaN or infinite value."""


class LateEventError(StreamInputError):
    """An event's timestamp is further behind the watermark than the allowed lateness."""


class TimestampRangeError(StreamInputError):
    """An event's timestamp is negative or above 2**62 ms."""


class UnknownFieldError(ValueError):
    """A key or value field name is not one the engine was configured with."""


class PatternError(ValueError):
    """A trigger pattern, window or feature is malformed."""


class BatchFormatError(TypeError):
    """A pushed array has the wrong dtype or shape."""


class SnapshotError(ValueError):
    """Bytes `StreamEngine.restore` cannot use: not a snapshot, damaged or truncated.

    Also raised for a snapshot of another format version.
    """


class SnapshotMismatchError(SnapshotError):
    """A snapshot of an engine with another configuration or trigger set.

    The message names what differs: configuration fields, and triggers by id.
    """


class EngineStateError(RuntimeError):
    """The call is not allowed in the engine's current state."""


@dataclass(frozen=True)
class Window:
    """A window over one key's events: kind "sliding"/"tumbling" (ms) or "count" (events)."""

    kind: Literal["sliding", "tumbling", "count"]
    size: int

    def __post_init__(self) -> None:
        limit = MAX_COUNT if self.kind == "count" else MAX_WINDOW_MS
        if self.kind not in ("sliding", "tumbling", "count"):
            raise PatternError(f"unknown window kind {self.kind!r}")
        if isinstance(self.size, bool) or not isinstance(self.size, int | np.integer):
            raise PatternError(f"{self.kind} window size must be an int, got {self.size!r}")
        if not 1 <= self.size <= limit:
            raise PatternError(f"{self.kind} window size must be in [1, {limit}], got {self.size}")

    @property
    def reach_ms(self) -> int:
        """How far behind a firing timestamp this window can look (0 for count windows)."""
        return {"sliding": self.size, "tumbling": 2 * self.size, "count": 0}[self.kind]

    def __str__(self) -> str:
        return f"{self.kind}({self.size}{'' if self.kind == 'count' else 'ms'})"


def sliding(ms: int) -> Window:
    """Events with ts in (fire_ts - ms, fire_ts]."""
    return Window("sliding", ms)


def tumbling(ms: int) -> Window:
    """Events in the last complete bucket [b - ms, b), b = floor(fire_ts / ms) * ms."""
    return Window("tumbling", ms)


def count(n: int) -> Window:
    """Select the key's last n events in arrival order (the firing event included)."""
    return Window("count", n)


AGGREGATIONS = ("count", "sum", "mean", "min", "max", "std", "last", "distinct", "histogram")


@dataclass(frozen=True)
class Feature:
    """One output column group: `agg` of value `field` over `window` of the trigger's key.

    `of` restricts the window to events of one type; `edges` (histogram only) are the
    strictly increasing bin edges, giving len(edges) - 1 columns.
    """

    agg: str
    field: str | None = None
    window: Window = Window("count", 1)
    of: str | None = None
    edges: tuple[float, ...] = ()

    def __str__(self) -> str:
        arg = self.field or ""
        of = f"[of={self.of}]" if self.of else ""
        return f"{self.agg}({arg})@{self.window}{of}"


@dataclass(frozen=True)
class CompiledFeature:
    """A feature as both engines consume it: codes and indices only."""

    agg: int  # index into AGGREGATIONS
    field: int  # value-field index, -1 for count
    window_kind: int  # 0 sliding, 1 tumbling, 2 count
    window_size: int
    of: int  # event-type code, -1 for all types
    edges: tuple[float, ...]
    name: str

    @property
    def width(self) -> int:
        """Number of output columns."""
        return len(self.edges) - 1 if AGGREGATIONS[self.agg] == "histogram" else 1

    @property
    def reach_ms(self) -> int:
        """How far behind a firing timestamp the feature's window can look."""
        return (self.window_size, 2 * self.window_size, 0)[self.window_kind]


CMP_OPS = ("==", "!=", "<", "<=", ">", ">=")
CONTIGUOUS, GAP = 0, 1  # "->" and "~>"


@dataclass(frozen=True)
class Condition:
    """`field cmp literal`; key fields compare as int64, value fields as float64."""

    on_value: bool
    field: int
    cmp: int  # index into CMP_OPS
    literal: float | int


@dataclass(frozen=True)
class Step:
    """One pattern step: an event type, its conditions, and how it follows the previous."""

    type: int
    op: int  # CONTIGUOUS or GAP; ignored for the first step
    conditions: tuple[Condition, ...]


@dataclass(frozen=True)
class TriggerSpec:
    """A compiled trigger: pattern steps, partition key, span and features."""

    id: int
    pattern: str
    by: int
    within_ms: int  # -1: no span limit
    steps: tuple[Step, ...]
    features: tuple[CompiledFeature, ...]

    @property
    def width(self) -> int:
        """Number of feature columns this trigger outputs."""
        return sum(f.width for f in self.features)


@dataclass(frozen=True)
class EngineConfig:
    """The engine's fixed schema and limits (validated by `EngineConfig.create`)."""

    event_types: tuple[str, ...]
    key_fields: tuple[str, ...]
    value_fields: tuple[str, ...]
    lateness_ms: int
    max_keys: int
    key_ttl_ms: int  # -1: keys never expire by age

    @classmethod
    def create(
        cls,
        event_types: Sequence[str],
        key_fields: Sequence[str],
        value_fields: Sequence[str],
        lateness_ms: int,
        max_keys: int,
        key_ttl_ms: int | None,
    ) -> EngineConfig:
        """Validate and freeze an engine configuration."""
        names = {"event type": event_types, "key field": key_fields, "value field": value_fields}
        for what, items in names.items():
            for name in items:
                if not isinstance(name, str) or not _NAME.fullmatch(name):
                    raise ValueError(f"{what} name {name!r} is not an identifier")
            if len(set(items)) != len(items):
                raise ValueError(f"duplicate {what} names in {list(items)!r}")
        if not event_types:
            raise ValueError("at least one event type is required")
        if set(key_fields) & set(value_fields):
            raise ValueError("key and value fields must have distinct names")
        if len(event_types) >= 1 << 31:
            raise ValueError("too many event types")
        _check_int("lateness_ms", lateness_ms, 0, MAX_WINDOW_MS)
        _check_int("max_keys", max_keys, 1, 1 << 31)
        if key_ttl_ms is not None:
            _check_int("key_ttl_ms", key_ttl_ms, 0, MAX_TS)
        return cls(
            tuple(event_types),
            tuple(key_fields),
            tuple(value_fields),
            int(lateness_ms),
            int(max_keys),
            -1 if key_ttl_ms is None else int(key_ttl_ms),
        )

    def compile_trigger(
        self,
        trigger_id: int,
        pattern: str,
        by: str,
        within_ms: int | None,
        features: Sequence[Feature],
    ) -> TriggerSpec:
        """Parse and check a trigger against this schema (raises PatternError)."""
        if by not in self.key_fields:
            raise PatternError(f"partition key {by!r} is not a key field {list(self.key_fields)}")
        if within_ms is not None:
            _check_int("within_ms", within_ms, 0, MAX_TS, PatternError)
        steps = parse_pattern(pattern, self)
        compiled = tuple(self._compile_feature(f) for f in features)
        return TriggerSpec(
            trigger_id,
            pattern,
            self.key_fields.index(by),
            -1 if within_ms is None else int(within_ms),
            steps,
            compiled,
        )

    def _compile_feature(self, feature: Feature) -> CompiledFeature:
        if not isinstance(feature, Feature):
            raise PatternError(f"features must be Feature instances, got {feature!r}")
        if feature.agg not in AGGREGATIONS:
            raise PatternError(f"unknown aggregation {feature.agg!r}; one of {AGGREGATIONS}")
        if not isinstance(feature.window, Window):
            raise PatternError(f"feature window must be a Window, got {feature.window!r}")
        if feature.agg == "count":
            if feature.field is not None:
                raise PatternError("count takes no field")
            field = -1
        elif feature.field not in self.value_fields:
            raise PatternError(
                f"{feature.agg} needs a value field of {list(self.value_fields)}, "
                f"got {feature.field!r}"
            )
        else:
            field = self.value_fields.index(feature.field)
        edges = tuple(float(e) for e in feature.edges)
        if feature.agg == "histogram":
            ok = 2 <= len(edges) <= MAX_EDGES and all(math.isfinite(e) for e in edges)
            if not ok or any(a >= b for a, b in zip(edges, edges[1:], strict=False)):
                raise PatternError(
                    f"histogram edges must be 2..{MAX_EDGES} finite, strictly increasing "
                    f"numbers, got {feature.edges!r}"
                )
        elif edges:
            raise PatternError(f"only histogram takes edges, not {feature.agg}")
        if feature.of is not None and feature.of not in self.event_types:
            raise UnknownEventTypeError(f"feature filter of={feature.of!r} is not an event type")
        of = -1 if feature.of is None else self.event_types.index(feature.of)
        kind = ("sliding", "tumbling", "count").index(feature.window.kind)
        agg = AGGREGATIONS.index(feature.agg)
        return CompiledFeature(agg, field, kind, feature.window.size, of, edges, str(feature))


def _check_int(name: str, value: object, lo: int, hi: int, error: type = ValueError) -> None:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise error(f"{name} must be an int, got {value!r}")
    if not lo <= value <= hi:
        raise error(f"{name} must be in [{lo}, {hi}], got {value}")


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_TOKEN = re.compile(
    r"\s*(?:(?P<arrow>->|~>)|(?P<cmp>==|!=|<=|>=|<|>)"
    r"|(?P<num>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"
    r"|(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<punct>[\[\],]))"
)


def _tokenize(text: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if match is None or match.end() == pos:
            raise PatternError(f"unexpected character {text[pos:].lstrip()[:1]!r} in {text!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    return tokens


def parse_pattern(text: str, config: EngineConfig) -> tuple[Step, ...]:
    """Parse `type[cond, ...] (-> | ~>) type[...] ...` into steps (raises PatternError)."""
    if not isinstance(text, str) or not text.strip():
        raise PatternError(f"pattern must be a non-empty string, got {text!r}")
    tokens = _tokenize(text)
    steps: list[Step] = []
    pos, op = 0, CONTIGUOUS
    while True:
        step, pos = _parse_step(tokens, pos, op, text, config)
        steps.append(step)
        if pos == len(tokens):
            return tuple(steps)
        kind, value = tokens[pos]
        if kind != "arrow":
            raise PatternError(f"expected '->' or '~>' before {value!r} in {text!r}")
        op = CONTIGUOUS if value == "->" else GAP
        pos += 1


def _parse_step(
    tokens: list[tuple[str, str]], pos: int, op: int, text: str, config: EngineConfig
) -> tuple[Step, int]:
    if pos >= len(tokens) or tokens[pos][0] != "name":
        found = repr(tokens[pos][1]) if pos < len(tokens) else "end of pattern"
        raise PatternError(f"expected an event type, found {found} in {text!r}")
    name = tokens[pos][1]
    if name not in config.event_types:
        raise PatternError(f"unknown event type {name!r} in pattern {text!r}")
    pos += 1
    conditions: list[Condition] = []
    if pos < len(tokens) and tokens[pos] == ("punct", "["):
        while True:
            cond, pos = _parse_condition(tokens, pos + 1, text, config)
            conditions.append(cond)
            if pos < len(tokens) and tokens[pos] == ("punct", ","):
                continue
            if pos < len(tokens) and tokens[pos] == ("punct", "]"):
                pos += 1
                break
            raise PatternError(f"expected ',' or ']' after a condition in {text!r}")
    return Step(config.event_types.index(name), op, tuple(conditions)), pos


def _parse_condition(
    tokens: list[tuple[str, str]], pos: int, text: str, config: EngineConfig
) -> tuple[Condition, int]:
    kinds = [k for k, _ in tokens[pos : pos + 3]]
    if kinds != ["name", "cmp", "num"]:
        raise PatternError(f"expected 'field <op> number' in {text!r}")
    field, cmp, literal = (v for _, v in tokens[pos : pos + 3])
    if field in config.key_fields:
        if not re.fullmatch(r"[-+]?\d+", literal) or not -(1 << 63) <= int(literal) < 1 << 63:
            raise PatternError(f"key field {field!r} compares with int64 literals, got {literal}")
        cond = Condition(False, config.key_fields.index(field), CMP_OPS.index(cmp), int(literal))
    elif field in config.value_fields:
        value = float(literal)
        if not math.isfinite(value):
            raise PatternError(f"literal {literal} for {field!r} is not finite")
        cond = Condition(True, config.value_fields.index(field), CMP_OPS.index(cmp), value)
    else:
        raise PatternError(f"unknown field {field!r} in pattern {text!r}")
    return cond, pos + 3
