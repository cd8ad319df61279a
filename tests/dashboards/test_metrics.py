"""/metrics after a simulated fleet reported through a guarded rollout, and the Grafana
dashboard's queries against the metric names the server really exports."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

import dashboards
from dashboards.metrics import class_label, slice_label
from tests.control_plane.sim.conftest import MODEL
from tests.control_plane.sim.test_guardrails import SLOW_SOC, N
from tests.dashboards.conftest import Site

# One worker runs the module, so its scenario (the `site` fixture) is built once.
pytestmark = pytest.mark.xdist_group("dashboard-metrics")

GRAFANA = Path(dashboards.__file__).parent / "grafana" / "skiff-fleet.json"
LATENCY = "skiff_inference_latency_seconds"


def _scrape(site: Site) -> dict:
    r = site.http().get(site.url + "metrics", headers={"Authorization": f"Bearer {site.cp.token}"})
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    samples: dict = {}
    for family in text_string_to_metric_families(r.text):
        # Declared names count even before a first sample (a counter no device has hit).
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
        for suffix in suffixes.get(family.type, ("",)):
            samples.setdefault(family.name + suffix, [])
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def _value(samples: dict, name: str, **labels) -> float:
    return sum(v for got, v in samples.get(name, []) if labels.items() <= got.items())


def test_fleet_and_rollout_gauges(site):
    m = _scrape(site)
    assert _value(m, "skiff_devices", platform="android") == N
    assert _value(m, "skiff_devices", platform="android", state="online") == N
    assert _value(m, "skiff_rollout_state", rollout=site.guarded, state="completed") == 1
    assert _value(m, "skiff_rollout_state", rollout=site.guarded, state="active") == 0
    assert _value(m, "skiff_rollout_stage_percent", rollout=site.staged) == 50
    doc = site.cli("rollout", "show", site.staged)
    statuses = {g["status"] for g, _ in m["skiff_rollout_devices"] if g["rollout"] == site.staged}
    # The reasons are mappings: no gauge.
    assert statuses == set(doc["counts"]) - {"ineligible_reasons", "waiting_reasons"}
    # Which devices a rollout selects and stages is fixed; synced and installed move with
    # the fleet's reports (and the gauges are read at most every 10 s).
    for status in ("selected", "in_stage"):
        got = _value(m, "skiff_rollout_devices", rollout=site.staged, status=status)
        assert got == doc["counts"][status] > 0


def _agrees(m: dict, family: str, labels: dict, agg) -> None:
    """The exported counters and latency histogram of one label set equal its rollup."""
    prefix = "skiff_rollout_" if family == "rollout" else "skiff_"
    assert _value(m, f"{prefix}inferences_total", **labels) == agg.inferences > 0
    assert _value(m, f"{prefix}crashes_total", **labels) == agg.crashes
    assert _value(m, f"{prefix}errors_total", **labels) == agg.errors
    latency = "skiff_rollout_latency_seconds" if family == "rollout" else LATENCY
    count = _value(m, f"{latency}_count", **labels)
    assert count == agg.latency_count
    buckets = sorted(
        (float(got["le"]), v) for got, v in m[f"{latency}_bucket"] if labels.items() <= got.items()
    )
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == count  # cumulative; +Inf is all
    # The bucket holding the median agrees with the rollup's own p50.
    p50_s = agg.quantile_us(0.5) / 1e6
    below = [v for le, v in buckets if le < p50_s]
    above = [v for le, v in buckets if le >= p50_s]
    assert (not below or below[-1] <= count / 2) and above[0] >= count / 2


def _rolled_up(site: Site, group, **where) -> tuple[dict, dict]:
    """Roll up what is pending; return the scrape and the minute rollups merged by `group`."""
    site.cp.app.roller.roll()
    epoch = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)
    merged = site.cp.app.store.merged_rollups(
        resolution_s=60, since=epoch, group=lambda _at, k: group(k), **where
    )
    return _scrape(site), merged


def test_counters_and_latency_agree_with_the_rollups(site):
    # The simulated fleet's model: the boards' 40 classes of VARIANTS_MODEL pool as
    # "other" past the per-version bound (test_metrics_bounds checks that).
    m, merged = _rolled_up(
        site, lambda k: (k.model, k.version, k.variant, k.config, k.device_class), model=MODEL
    )
    configs = {key[3] for key in merged}
    assert len(merged) > len(configs) > 1  # several backend configs and device classes
    for (model, version, variant, config, device_class), agg in merged.items():
        labels = {
            "model": model,
            "version": str(version),
            "variant": variant,
            "config": config,
            "device_class": class_label(device_class),
        }
        assert "soc=" in labels["device_class"]
        _agrees(m, "fleet", labels, agg)


def test_rollout_cohorts_and_slices_agree_with_the_health_view(site):
    """What guardrails judge is exported per rollout, cohort and slice: Grafana can show
    a candidate beside its baseline, and which slices were rolled back."""
    m, merged = _rolled_up(site, lambda k: (k.cohort, k.device_class), rollout=site.guarded)
    assert {cohort for cohort, _ in merged} == {"candidate", "baseline"}
    for (cohort, slice_class), agg in merged.items():
        labels = {"rollout": site.guarded, "cohort": cohort, "slice": slice_label(slice_class)}
        assert labels["slice"].startswith("soc=")
        _agrees(m, "rollout", labels, agg)
    rolled_back = {
        got["slice"]
        for got, v in m["skiff_rollout_slice_rolled_back"]
        if got["rollout"] == site.guarded and v == 1
    }
    doc = site.cli("rollout", "show", site.guarded)
    assert (
        rolled_back
        == {s["slice"] for s in doc["health"]["slices"] if s["state"] == "rolled_back"}
        == {f"soc={SLOW_SOC}"}
    )


def test_every_grafana_query_names_an_exported_metric(site):
    exported = set(_scrape(site))
    board = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    named = {name for e in exprs for name in re.findall(r"\bskiff_[a-z0-9_]+", e)}
    assert named and named <= exported, named - exported
    # Every family the server exports is on the board.
    families = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in exported}
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", n) for n in named}
    assert families == shown, families ^ shown
