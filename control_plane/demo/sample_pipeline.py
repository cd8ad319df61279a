"""A sample event pipeline for the 16-input MLP of `sample_models`, and events for it.

The scenario: a shopping app pushes `tap`, `scroll` and `purchase` events per user; when
a user buys after tapping (within a minute), the model scores the purchase from sixteen
features of the user's recent activity. Used by the demo, the tests and the bench.
"""

from __future__ import annotations

import numpy as np

__all__ = ["EVENT_TYPES", "activity_events", "activity_pipeline", "event_messages"]

EVENT_TYPES = ("tap", "scroll", "purchase")


def activity_pipeline(input_name: str = "x") -> dict:
    """Return the pipeline spec (JSON data): one trigger filling a [1, 16] input."""
    minute = 60_000
    return {
        "event_types": list(EVENT_TYPES),
        "key_fields": ["user"],
        "value_fields": ["dwell_ms", "amount"],
        "lateness_ms": 5_000,
        "max_keys": 10_000,
        "key_ttl_ms": 3_600_000,
        "triggers": [
            {
                "name": "checkout",
                "pattern": "tap ~> purchase[amount > 0]",
                "by": "user",
                "within_ms": minute,
                "input": input_name,
                "features": [
                    {"agg": "count", "window": {"sliding_ms": minute}},
                    {
                        "agg": "mean",
                        "field": "dwell_ms",
                        "window": {"sliding_ms": minute},
                        "of": "tap",
                    },
                    {"agg": "max", "field": "amount", "window": {"sliding_ms": minute}},
                    {"agg": "sum", "field": "amount", "window": {"tumbling_ms": minute}},
                    {"agg": "std", "field": "dwell_ms", "window": {"count": 32}},
                    {"agg": "last", "field": "amount", "window": {"count": 1}},
                    {
                        "agg": "histogram",
                        "field": "dwell_ms",
                        "window": {"count": 32},
                        "edges": [0, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 60000],
                    },
                ],
            }
        ],
    }


def activity_events(
    n: int, *, users: int = 100, start_ms: int = 1_700_000_000_000, seed: int = 0
) -> tuple[np.ndarray, list[str], np.ndarray, np.ndarray]:
    """Return n events in time order: ts (int64), type names, keys [n, 1], values [n, 2].

    About one event in twelve is a purchase, so the pipeline fires often but not always.
    """
    rng = np.random.default_rng(seed)
    ts = start_ms + np.cumsum(rng.integers(1, 50, n)).astype(np.int64)
    kinds = rng.choice(len(EVENT_TYPES), n, p=[0.6, 0.32, 0.08])
    types = [EVENT_TYPES[k] for k in kinds]
    keys = rng.integers(0, users, (n, 1)).astype(np.int64)
    dwell = rng.lognormal(6, 1, n)
    amount = np.where(kinds == 2, rng.uniform(1, 200, n).round(2), 0.0)
    values = np.stack([dwell, amount], axis=1)
    return ts, types, keys, values


def event_messages(ts, types, keys, values) -> list:
    """Return events as the local API's `agent_pb2.Event` messages (keys, values in order)."""
    from protos import agent_pb2

    return [
        agent_pb2.Event(ts_ms=int(t), type=k, keys=[int(x) for x in key], values=list(value))
        for t, k, key, value in zip(ts, types, keys, values, strict=True)
    ]
