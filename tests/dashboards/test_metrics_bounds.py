"""/metrics label sets stay bounded however many versions, configs and classes report,
and no device (nor a fleet of many device models) crowds out a new version's series."""

from __future__ import annotations

import datetime as dt
from types import SimpleNamespace

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from control_plane.store.base import ModelRecord
from control_plane.store.report_records import ModelStatsRecord
from control_plane.store.rollup_aggregate import Aggregate
from control_plane.store.rollup_records import RollupKey
from control_plane.telemetry.roller import HOUR, MINUTE
from dashboards import metrics
from runtime.histogram import LatencyHistogram

AT = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)
CPU = "CPU/normal/t4/mem-normal"


def _agg(n: int) -> Aggregate:
    h = LatencyHistogram()
    h.record_many_ns(np.full(n, 2_000_000))
    agg = Aggregate()
    agg.add_stats(ModelStatsRecord("m", 1, "fp32", "c", n, 0, 0, h.to_dict()))
    return agg


class Registry:
    """The registry's one method /metrics reads: published models, latest versions."""

    def __init__(self, **latest: int) -> None:
        self.latest, self.reads = latest, 0

    def list_models(self, *, after: str = "", limit: int | None = None) -> list[ModelRecord]:
        self.reads += 1
        names = sorted(n for n in self.latest if n > after)[:limit]
        return [ModelRecord(n, AT, self.latest[n], self.latest[n]) for n in names]


@pytest.fixture
def plane(monkeypatch):
    """Metrics over a fake app; returns (metrics, roll(deltas), registry)."""
    monkeypatch.setattr(metrics, "PER_VERSION", 4)
    monkeypatch.setattr(metrics, "PER_ROLLOUT", 3)
    observers = []
    registry = Registry(det=2)
    app = SimpleNamespace(roller=SimpleNamespace(observe=observers.append), registry=registry)
    m = metrics.Metrics(app)
    monkeypatch.setattr(m, "scrape_families", lambda: [])
    (on_rolled,) = observers
    return m, on_rolled, registry


def _samples(m: metrics.Metrics, name: str) -> list[tuple[dict, float]]:
    text = m.render()[0].decode()
    return [
        (s.labels, s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    ]


def _fleet(model: str, version: int, soc: str, n: int = 10) -> dict:
    key = RollupKey(model, version, "fp32", CPU, f'{{"soc": "{soc}"}}')
    return {(MINUTE, AT, key): _agg(n), (HOUR, AT, key): _agg(n)}  # hours: not again


def test_a_version_gets_its_own_series_then_its_own_pool(plane):
    m, roll, _ = plane
    deltas = {}
    for i in range(6):  # six device classes of det:2, four places for it
        deltas.update(_fleet("det", 2, f"s{i}", 10 + i))
    roll(deltas)
    got = {s["device_class"]: v for s, v in _samples(m, "skiff_inferences_total")}
    assert got == {"soc=s0": 10, "soc=s1": 11, "soc=s2": 12, "other": 13 + 14 + 15}
    pooled = [s for s, _ in _samples(m, "skiff_inferences_total") if s["config"] == "other"]
    assert pooled == [{**pooled[0], "model": "det", "version": "2", "device_class": "other"}]


def test_reports_of_unpublished_models_or_versions_cannot_take_places(plane):
    """A device may report any well-formed model name: 1024 made-up models used up every
    label set, and the next real version showed up as 'other' everywhere."""
    m, roll, registry = plane
    flood = {}
    for i in range(1024):
        flood.update(_fleet(f"fake{i}", 1, "s0", 1))
    flood.update(_fleet("det", 9, "s0", 1))  # a version that does not exist
    roll(flood)
    registry.latest["det"] = 3  # published after the flood: seen at the next round
    m._published_at -= 5  # the next round comes a roll-up interval later
    roll(_fleet("det", 3, "s1", 7))
    labels = {
        (s["model"], s["version"], s["device_class"]): v
        for s, v in _samples(m, "skiff_inferences_total")
    }
    assert labels == {("other", "other", "other"): 1025, ("det", "3", "soc=s1"): 7}
    assert registry.reads <= 3  # re-read when a report names something new, not per key


def test_a_rollout_keeps_its_own_pool(plane):
    m, roll, _ = plane
    deltas = {}
    for i in range(5):  # a device that keeps changing the attribute a rollout slices by
        key = RollupKey("det", 2, "fp32", "c", f'{{"soc": "r{i}"}}', "ro_1", "candidate")
        deltas[MINUTE, AT, key] = _agg(100)
    key = RollupKey("det", 2, "fp32", "c", '{"soc": "long' + "x" * 500 + '"}', "ro_2", "baseline")
    deltas[MINUTE, AT, key] = _agg(5)
    roll(deltas)
    got = {(s["rollout"], s["slice"]): v for s, v in _samples(m, "skiff_rollout_inferences_total")}
    assert got[("ro_1", "other")] == 300 and len([k for k in got if k[0] == "ro_1"]) == 3
    (long,) = [s for r, s in got if r == "ro_2"]
    assert len(long) == metrics.MAX_LABEL and long.endswith("…")
