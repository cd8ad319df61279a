"""A health view is a function of the rollout's rows: the same rows give the same view,
to the last digit, in any interpreter (a set's order differs with the hash seed)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json

import numpy as np
import pytest

from control_plane.rollouts.guard import Guard
from control_plane.rollouts.resolver import Resolver
from control_plane.store.sql_store import SqlStore
from tests.control_plane.telemetry.test_rollups import (
    CLASS,
    NOW,
    enroll,
    half,
    released,
    report,
    roller,
    stats,
)
from tests.fresh_interpreter import printed_json

SOCS = [f"soc{i:02d}" for i in range(12)]


def _record():
    return dataclasses.replace(
        half(slice_by="soc"),
        selector="",
        created_at=NOW - dt.timedelta(hours=2),
        stage_started_at=NOW - dt.timedelta(hours=1),
        halt_rules=("p95_latency_ratio>1.2", "error_rate>0.05"),
        min_devices=1,
    )


def health_json(url: str) -> str:
    """Return the rollout's health view, every float at full precision."""
    store = SqlStore(url)
    try:
        clock = lambda: NOW + dt.timedelta(seconds=1)  # noqa: E731
        health = Guard(store, None, CLASS, clock=clock).health(_record())
        return json.dumps(health.to_dict(), sort_keys=True, default=repr)
    finally:
        store.close()


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


def test_a_health_view_does_not_depend_on_the_hash_seed(store, db_url):
    record = _record()
    rng = np.random.default_rng(7)
    during = NOW - dt.timedelta(minutes=10)
    included = Resolver(store=None).live(record).includes
    for i in range(72):
        soc = SOCS[i % len(SOCS)]
        device = enroll(store, soc=soc)
        version = 2 if included(device) else 1
        latencies = rng.lognormal(7 + 0.05 * (i % 5) + 0.2 * (version == 2), 0.4, 300)
        errors = int(rng.integers(0, 30))
        report(store, device, f"b-{i:03d}", stats(version, latencies, errors=errors), at=during)
    roller(store, released(), record).roll()

    views = {
        seed: printed_json(
            "import json\n"
            "from tests.control_plane.rollouts.test_guard_order import health_json\n"
            f"print(json.dumps(health_json({db_url!r})))",
            env={"PYTHONHASHSEED": str(seed)},
        )
        for seed in (0, 1, 2)
    }
    first = views[0]
    assert len(json.loads(first)["slices"]) == len(SOCS)
    for seed, view in views.items():
        assert view == first, f"PYTHONHASHSEED={seed} gave another health view"
