"""/metrics label sets stay bounded however many versions, configs and classes report."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from control_plane.store.rollups import Aggregate, RollupKey
from control_plane.store.telemetry import ModelStatsRecord
from control_plane.telemetry.rollups import HOUR, MINUTE
from dashboards import metrics
from runtime.histogram import LatencyHistogram

AT = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)


def _agg(n: int) -> Aggregate:
    h = LatencyHistogram()
    h.record_many_ns(np.full(n, 2_000_000))
    agg = Aggregate()
    agg.add_stats(ModelStatsRecord("m", 1, "fp32", "c", n, 0, 0, h.to_dict()))
    return agg


def _series(m: metrics.Metrics, name: str) -> list[dict]:
    text = m.render()[0].decode()
    return [
        s.labels
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def test_label_sets_past_the_bound_are_counted_as_other(monkeypatch):
    monkeypatch.setattr(metrics, "MAX_SERIES", 3)
    monkeypatch.setattr(metrics, "MAX_ROLLOUT_SERIES", 2)
    observers = []
    app = SimpleNamespace(roller=SimpleNamespace(observe=observers.append))
    m = metrics.Metrics(app)
    monkeypatch.setattr(m, "scrape_families", lambda: [m._latency.family()])
    (on_rolled,) = observers
    deltas = {}
    for i in range(5):  # five device classes of one version: two past the bound
        key = RollupKey("det", 2, "fp32", "CPU/normal/t4/mem-normal", f'{{"soc": "s{i}"}}')
        deltas[MINUTE, AT, key] = _agg(10 + i)
        deltas[HOUR, AT, key] = _agg(10 + i)  # other resolutions are not counted again
    for i, cohort in enumerate(("candidate", "baseline", "candidate")):
        key = RollupKey("det", 2, "fp32", "c", f'{{"soc": "r{i}"}}', "ro_1", cohort)
        deltas[MINUTE, AT, key] = _agg(100)
    on_rolled(deltas)

    fleet = _series(m, "skiff_inferences_total")
    classes = sorted(s["device_class"] for s in fleet)
    assert classes == ["other", "soc=s0", "soc=s1", "soc=s2"]
    other = [s for s in fleet if s["device_class"] == "other"][0]
    assert set(other.values()) == {"other"}  # every label, so no half-known series
    total = sum(
        s.value
        for f in text_string_to_metric_families(m.render()[0].decode())
        for s in f.samples
        if s.name == "skiff_inferences_total"
    )
    assert total == sum(10 + i for i in range(5))  # nothing lost, only pooled
    cohorts = _series(m, "skiff_rollout_inferences_total")
    rollout = sorted((s["cohort"], s["slice"]) for s in cohorts)
    assert rollout == [("baseline", "soc=r1"), ("candidate", "soc=r0"), ("other", "other")]
