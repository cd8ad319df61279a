"""Event pipelines: a model version's stream-processing spec, checked and run.

A pipeline turns a device's raw events into model runs. The publisher gives it at push
time as JSON; the control plane checks it against the model's input signature and signs
it into the version's manifest; the agent builds a `StreamEngine` from it and, at each
trigger firing, runs the model on the firing's features. The spec::

    {
      "event_types": ["tap", "purchase"],          # what apps may push
      "key_fields": ["user"],                       # int64 per event
      "value_fields": ["dwell", "amount"],          # float64 per event
      "lateness_ms": 5000,                          # optional, default 0
      "max_keys": 10000,                            # optional, default 100000
      "key_ttl_ms": 3600000,                        # optional, default: no expiry
      "triggers": [{
        "name": "checkout",                         # reported with each result
        "pattern": "tap ~> purchase[amount > 10]",  # runtime.stream pattern syntax
        "by": "user",                               # the partition key field
        "within_ms": 60000,                         # optional span of the match
        "input": "x",                               # the model input the features fill
        "shape": [1, 3],                            # optional, see below
        "missing": 0.0,                             # optional, see below
        "features": [
          {"agg": "mean", "field": "dwell", "window": {"sliding_ms": 60000}, "of": "tap"},
          {"agg": "count", "window": {"count": 16}},
          {"agg": "max", "field": "amount", "window": {"tumbling_ms": 60000}}
        ]
      }]
    }

Windows are `{"sliding_ms": N}`, `{"tumbling_ms": N}` or `{"count": N}`; aggregations
and their semantics are `runtime.stream`'s (`histogram` takes `"edges"`).

**How features fill the input.** A firing's feature columns, in order (a histogram gives
one column per bin), fill the trigger's `input` tensor in C order, cast to its dtype
(float32 or float64 inputs only). The tensor's shape is `shape` if given, else the model's
declared input shape with a leading batch dimension (dynamic or 1) taken as 1; every
other dimension must then be fixed. Its element count must equal the number of columns.
The model must have exactly one input. An empty window's mean, min, max, std or last is
NaN, which no model input accepts: `missing` (default 0.0) takes its place.

Everything is checked strictly: an unknown key, a wrong type, an unknown event type or
field, a bad pattern, a feature count that does not fit the input: `PipelineError`
naming where (`triggers[0].features[2].window: ...`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.pipeline_spec import (
    MAX_PIPELINE_BYTES,
    InputFit,
    PipelineError,
    PipelineSpec,
    parse_pipeline,
)
from runtime.stream_spec import StreamInputError

__all__ = [
    "MAX_PIPELINE_BYTES",
    "FeatureOverflow",
    "Firing",
    "InputFit",
    "Pipeline",
    "PipelineError",
    "PipelineSpec",
    "parse_pipeline",
]


class FeatureOverflow(ValueError):
    """A firing's feature values do not fit the model input's dtype (e.g. float16)."""


@dataclass(frozen=True)
class Firing:
    """One trigger firing: which trigger, the key and event time, and its feature row.

    `inputs` builds the model's input when asked, so a push holds one float64 row per
    firing (a view of the engine's matrix), not a copy per firing of every input.
    """

    trigger: str
    key: int
    ts: int
    window_start: int
    window_end: int
    row: np.ndarray
    fit: InputFit
    missing: float

    @property
    def inputs(self) -> dict[str, np.ndarray]:
        """Return the model input: NaN (empty windows) as `missing`, cast and shaped.

        FeatureOverflow if a value does not fit the input's dtype.
        """
        row = np.where(np.isnan(self.row), self.missing, self.row)
        with np.errstate(over="ignore"):
            cast = row.astype(self.fit.dtype)
        if not np.isfinite(cast).all():
            bad = int(np.flatnonzero(~np.isfinite(cast))[0])
            raise FeatureOverflow(
                f"trigger {self.trigger}: feature column {bad} ({row[bad]:g}) does not fit "
                f"input {self.fit.name!r} ({self.fit.dtype})"
            )
        return {self.fit.name: cast.reshape(self.fit.shape)}


class Pipeline:
    """A spec's `StreamEngine`, turning pushed events into model inputs. Not thread-safe."""

    def __init__(self, spec: PipelineSpec, fits: Mapping[str, InputFit]) -> None:
        from runtime.stream import StreamEngine

        c = spec.config
        self.spec = spec
        self.engine = StreamEngine(
            event_types=c.event_types,
            key_fields=c.key_fields,
            value_fields=c.value_fields,
            lateness_ms=c.lateness_ms,
            max_keys=c.max_keys,
            key_ttl_ms=None if c.key_ttl_ms < 0 else c.key_ttl_ms,
        )
        for t in spec.triggers:
            self.engine.add_trigger(t.pattern, by=t.by, features=t.features, within_ms=t.within_ms)
        self._fits = [fits[t.name] for t in spec.triggers]
        self._codes = {name: i for i, name in enumerate(c.event_types)}

    @classmethod
    def for_model(cls, doc: Any, signature: Any) -> Pipeline:
        """Build the pipeline of a spec (JSON data) for a `runtime.Signature`'s inputs."""
        spec = parse_pipeline(doc)
        inputs = [
            {"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in signature.inputs
        ]
        return cls(spec, spec.fit(inputs))

    def carry_over(self, old: Pipeline) -> bool:
        """Take `old`'s windows and partial matches if its spec is the same; say if it was."""
        if old.spec.canonical() != self.spec.canonical():
            return False
        self.engine.restore(old.engine.snapshot())
        return True

    def push(
        self,
        ts: np.ndarray,
        types: Sequence[str],
        keys: np.ndarray,
        values: np.ndarray,
    ) -> list[Firing]:
        """Push a batch (type names; arrays as `StreamEngine.push_batch`); return its firings.

        The batch is checked whole first: StreamInputError (naming the event) or
        BatchFormatError, and the engine is unchanged.
        """
        codes = np.empty(len(types), dtype=np.int32)
        for i, name in enumerate(types):
            code = self._codes.get(name)
            if code is None:
                raise _unknown_type(name, i, self.spec.config.event_types)
            codes[i] = code
        fired = self.engine.push_batch(ts, codes, keys, values)
        out = []
        for i in range(len(fired)):
            tid = int(fired.trigger_id[i])
            trigger = self.spec.triggers[tid]
            out.append(
                Firing(
                    trigger=trigger.name,
                    key=int(fired.key[i]),
                    ts=int(fired.ts[i]),
                    window_start=int(fired.window_start[i]),
                    window_end=int(fired.window_end[i]),
                    row=fired.feature_row(i),
                    fit=self._fits[tid],
                    missing=trigger.missing,
                )
            )
        return out

    @property
    def width(self) -> int:
        """Feature values all triggers compute per event, at most (a push's memory bound)."""
        return sum(t.spec.width for t in self.spec.triggers)


def _unknown_type(name: str, index: int, known: tuple[str, ...]) -> StreamInputError:
    from runtime.stream_spec import UnknownEventTypeError

    return UnknownEventTypeError(
        f"event {index}: type {name!r:.60} is not one of the pipeline's {list(known)}", index
    )
