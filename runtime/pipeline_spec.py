"""Event pipeline specs: the JSON a publisher pushes, parsed strictly and fitted to a model.

The format and its rules are in `runtime.pipeline`, which runs a spec; this module
holds the checks both the control plane (at push) and the agent (at install) make:
`parse_pipeline` and `PipelineSpec.fit`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.stream_spec import (
    AGGREGATIONS,
    EngineConfig,
    Feature,
    TriggerSpec,
    Window,
)

__all__ = [
    "FLOAT_DTYPES",
    "MAX_PIPELINE_BYTES",
    "InputFit",
    "PipelineError",
    "PipelineSpec",
    "TriggerDef",
    "parse_pipeline",
]

MAX_PIPELINE_BYTES = 64 << 10
MAX_TRIGGERS = 64
MAX_FEATURES = 256
MAX_NAMES = 256
MAX_PATTERN = 1000
MAX_INPUT_VALUES = 1 << 16
# Tighter than the engine's own limits: a device's memory and a push's time stay bounded.
MAX_PIPELINE_KEYS = 1_000_000
MAX_COUNT_WINDOW = 1 << 16
MAX_DISTINCT_WINDOW = 4096  # distinct counts cost O(window) per firing
FLOAT_DTYPES = ("float32", "float64")  # what MNN's Python API feeds (runtime.signature)
_WINDOW_KINDS = {"sliding_ms": "sliding", "tumbling_ms": "tumbling", "count": "count"}
_TOP_KEYS = {"event_types", "key_fields", "value_fields", "lateness_ms", "max_keys"}
_TOP_KEYS |= {"key_ttl_ms", "triggers"}
_TRIGGER_KEYS = {"name", "pattern", "by", "within_ms", "input", "shape", "missing", "features"}
_FEATURE_KEYS = {"agg", "field", "window", "of", "edges"}


class PipelineError(ValueError):
    """A pipeline spec is malformed or does not fit the model; the message says where."""


@dataclass(frozen=True)
class TriggerDef:
    """One trigger of a spec: its compiled pattern and features, and the input it fills."""

    name: str
    spec: TriggerSpec
    pattern: str
    by: str
    within_ms: int | None
    features: tuple[Feature, ...]
    input: str
    shape: tuple[int, ...] | None
    missing: float


@dataclass(frozen=True)
class InputFit:
    """How one trigger's features become a model input: name, per-firing shape, dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class PipelineSpec:
    """A checked pipeline spec (see the module docstring); `to_json()` is its canonical form."""

    config: EngineConfig
    triggers: tuple[TriggerDef, ...]

    def to_json(self) -> dict[str, Any]:
        """Return the spec as plain JSON data, every default spelled out."""
        c = self.config
        return {
            "event_types": list(c.event_types),
            "key_fields": list(c.key_fields),
            "value_fields": list(c.value_fields),
            "lateness_ms": c.lateness_ms,
            "max_keys": c.max_keys,
            "key_ttl_ms": None if c.key_ttl_ms < 0 else c.key_ttl_ms,
            "triggers": [_trigger_json(t) for t in self.triggers],
        }

    def canonical(self) -> str:
        """Return the canonical JSON text (sorted keys, no spaces): equal specs, equal text."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))

    def fit(self, inputs: Sequence[Mapping[str, Any]]) -> dict[str, InputFit]:
        """Check the spec against a model's inputs (`[{name, shape, dtype}]`).

        Returns, per trigger name, the input its features fill; PipelineError says why a
        trigger does not fit.
        """
        if len(inputs) != 1:
            names = [str(i.get("name")) for i in inputs]
            raise PipelineError(
                f"a pipeline fills exactly one model input; the model has {len(names)}: {names}"
            )
        declared = inputs[0]
        fits = {}
        for i, t in enumerate(self.triggers):
            where = f"triggers[{i}] ({t.name})"
            if t.input != declared["name"]:
                raise PipelineError(
                    f"{where}.input: {t.input!r} is not the model's input {declared['name']!r}"
                )
            dtype = str(declared.get("dtype"))
            if dtype not in FLOAT_DTYPES:
                raise PipelineError(
                    f"{where}.input: {t.input!r} is {dtype}; pipeline features fill float "
                    f"inputs ({', '.join(FLOAT_DTYPES)})"
                )
            shape = _firing_shape(where, t, [int(d) for d in declared.get("shape", [])])
            width = t.spec.width
            if math.prod(shape) != width:
                raise PipelineError(
                    f"{where}: its features give {width} value(s) per firing; input "
                    f"{t.input!r} takes {math.prod(shape)} (shape {list(shape)})"
                )
            with np.errstate(over="ignore"):
                if not np.isfinite(np.array(t.missing, dtype=dtype)):
                    raise PipelineError(f"{where}.missing: {t.missing:g} does not fit {dtype}")
            fits[t.name] = InputFit(t.input, shape, dtype)
        return fits


def _firing_shape(where: str, t: TriggerDef, declared: list[int]) -> tuple[int, ...]:
    if t.shape is not None:
        if len(t.shape) != len(declared) or any(
            d > 0 and s != d for s, d in zip(t.shape, declared, strict=True)
        ):
            raise PipelineError(
                f"{where}.shape: {list(t.shape)} does not fit the input's declared shape {declared}"
            )
        return t.shape
    shape = list(declared)
    if len(shape) >= 2 and shape[0] <= 1:
        shape[0] = 1  # the batch dimension: one firing at a time
    if any(d <= 0 for d in shape):
        raise PipelineError(
            f"{where}: input {t.input!r} has dynamic dimensions {declared}: give the "
            'per-firing tensor "shape" in the trigger'
        )
    return tuple(shape)


def _trigger_json(t: TriggerDef) -> dict[str, Any]:
    return {
        "name": t.name,
        "pattern": t.pattern,
        "by": t.by,
        "within_ms": t.within_ms,
        "input": t.input,
        "shape": None if t.shape is None else list(t.shape),
        "missing": t.missing,
        "features": [_feature_json(f) for f in t.features],
    }


def _feature_json(f: Feature) -> dict[str, Any]:
    kind = {v: k for k, v in _WINDOW_KINDS.items()}[f.window.kind]
    out: dict[str, Any] = {"agg": f.agg, "window": {kind: f.window.size}}
    if f.field is not None:
        out["field"] = f.field
    if f.of is not None:
        out["of"] = f.of
    if f.edges:
        out["edges"] = list(f.edges)
    return out


# -- parsing ----------------------------------------------------------------------------------


def parse_pipeline(doc: Any) -> PipelineSpec:
    """Check a pipeline spec (parsed JSON, or JSON text); PipelineError names the problem."""
    if isinstance(doc, str | bytes):
        if len(doc) > MAX_PIPELINE_BYTES:
            raise PipelineError(f"pipeline spec is over {MAX_PIPELINE_BYTES} bytes")
        try:
            doc = json.loads(doc)
        except (ValueError, RecursionError) as exc:
            raise PipelineError(f"pipeline spec is not JSON: {exc}") from None
    _object("pipeline", doc, _TOP_KEYS, required={"event_types", "triggers"})
    lists = {}
    for key in ("event_types", "key_fields", "value_fields"):
        items = doc.get(key, [])
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise PipelineError(f"{key}: expected a list of names, got {_show(items)}")
        if len(items) > MAX_NAMES:
            raise PipelineError(f"{key}: at most {MAX_NAMES} names")
        lists[key] = items
    try:
        config = EngineConfig.create(
            lists["event_types"],
            lists["key_fields"],
            lists["value_fields"],
            _int("lateness_ms", doc.get("lateness_ms", 0)),
            _int("max_keys", doc.get("max_keys", 100_000), hi=MAX_PIPELINE_KEYS),
            None if doc.get("key_ttl_ms") is None else _int("key_ttl_ms", doc["key_ttl_ms"]),
        )
    except PipelineError:
        raise
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    triggers = doc["triggers"]
    if not isinstance(triggers, list) or not 1 <= len(triggers) <= MAX_TRIGGERS:
        raise PipelineError(f"triggers: expected a list of 1..{MAX_TRIGGERS} triggers")
    parsed = tuple(_trigger(f"triggers[{i}]", i, t, config) for i, t in enumerate(triggers))
    names = [t.name for t in parsed]
    if len(set(names)) != len(names):
        raise PipelineError(f"triggers: duplicate trigger names in {names}")
    return PipelineSpec(config, parsed)


def _trigger(where: str, index: int, t: Any, config: EngineConfig) -> TriggerDef:
    _object(where, t, _TRIGGER_KEYS, required={"name", "pattern", "by", "input", "features"})
    name = _name(f"{where}.name", t["name"])
    where = f"{where} ({name})"
    pattern = t["pattern"]
    if not isinstance(pattern, str) or len(pattern) > MAX_PATTERN:
        raise PipelineError(f"{where}.pattern: expected a string of at most {MAX_PATTERN} chars")
    by = t["by"]
    if not isinstance(by, str):
        raise PipelineError(f"{where}.by: expected a key field name, got {_show(by)}")
    within = t.get("within_ms")
    within = None if within is None else _int(f"{where}.within_ms", within)
    raw = t["features"]
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_FEATURES:
        raise PipelineError(f"{where}.features: expected a list of 1..{MAX_FEATURES} features")
    features = tuple(_feature(f"{where}.features[{j}]", f, config) for j, f in enumerate(raw))
    try:
        spec = config.compile_trigger(index, pattern, by, within, features)
    except ValueError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    if spec.width > MAX_INPUT_VALUES:
        raise PipelineError(f"{where}: {spec.width} feature values, at most {MAX_INPUT_VALUES}")
    shape = t.get("shape")
    if shape is not None:
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_INPUT_VALUES
            for d in shape
        ):
            raise PipelineError(f"{where}.shape: expected positive ints, got {_show(shape)}")
        shape = tuple(shape)
    missing = _finite(f"{where}.missing", t.get("missing", 0.0))
    return TriggerDef(
        name=name,
        spec=spec,
        pattern=pattern,
        by=by,
        within_ms=within,
        features=features,
        input=_name(f"{where}.input", t["input"], identifier=False),
        shape=shape,
        missing=missing,
    )


def _feature(where: str, f: Any, config: EngineConfig) -> Feature:
    _object(where, f, _FEATURE_KEYS, required={"agg", "window"})
    agg = f["agg"]
    if agg not in AGGREGATIONS:
        raise PipelineError(f"{where}.agg: {_show(agg)} is not one of {list(AGGREGATIONS)}")
    window = f["window"]
    if not isinstance(window, dict) or len(window) != 1 or next(iter(window)) not in _WINDOW_KINDS:
        raise PipelineError(
            f'{where}.window: expected one of {{"sliding_ms": N}}, {{"tumbling_ms": N}}, '
            f'{{"count": N}}, got {_show(window)}'
        )
    ((kind, size),) = window.items()
    edges = f.get("edges", [])
    if not isinstance(edges, list):
        raise PipelineError(f"{where}.edges: expected a list of numbers")
    edges = [_finite(f"{where}.edges", e) for e in edges]
    size = _int(f"{where}.window", size)
    limit = MAX_DISTINCT_WINDOW if agg == "distinct" else MAX_COUNT_WINDOW
    if kind == "count" and size > limit:
        raise PipelineError(f"{where}.window: a {agg} count window holds at most {limit} events")
    for key in ("field", "of"):
        if f.get(key) is not None and not isinstance(f[key], str):
            raise PipelineError(f"{where}.{key}: expected a name, got {_show(f[key])}")
    try:
        return Feature(
            agg,
            f.get("field"),
            Window(_WINDOW_KINDS[kind], size),
            f.get("of"),
            tuple(edges),
        )
    except PipelineError:
        raise
    except ValueError as exc:
        raise PipelineError(f"{where}: {exc}") from None


def _object(where: str, value: Any, allowed: set[str], required: set[str]) -> None:
    if not isinstance(value, dict):
        raise PipelineError(f"{where}: expected an object, got {_show(value)}")
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise PipelineError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(allowed)}")
    missing = sorted(required - set(value))
    if missing:
        raise PipelineError(f"{where}: missing {missing}")


def _int(where: str, value: Any, *, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PipelineError(f"{where}: expected an integer, got {_show(value)}")
    if hi is not None and value > hi:
        raise PipelineError(f"{where}: at most {hi}, got {value}")
    return value


def _finite(where: str, value: Any) -> float:
    """Return a JSON number as a finite float (a huge integer included), or PipelineError."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PipelineError(f"{where}: expected a finite number, got {_show(value)}")
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise PipelineError(f"{where}: expected a finite number, got {_show(value)}")
    return number


def _name(where: str, value: Any, *, identifier: bool = True) -> str:
    ok = isinstance(value, str) and 0 < len(value) <= 128 and value.isprintable()
    if ok and identifier:
        ok = value.isidentifier() and value.isascii()
    if not ok:
        raise PipelineError(f"{where}: {_show(value)} is not a valid name")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
