"""Prometheus metrics on the dashboard's port (`/metrics`, a viewer token as bearer).

Two kinds, each with bounded label sets:
- gauges read at scrape time (at most every SCRAPE_CACHE_S): devices by platform and
  state, and per rollout its state, stage and device counts (rollouts in progress, and
  those that ended in the last day);
- counters and a latency histogram this replica adds to as its roller merges device
  reports (sum them over replicas: each batch is rolled by exactly one). Labels are
  model, version and variant, at most MAX_SERIES combinations (the rest are "other").

The latency histogram's `le` bounds are boundaries of the devices' own histogram buckets
(powers of two microseconds), so converting is exact.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
from prometheus_client import (
    CollectorRegistry,
    Counter,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from control_plane.rollouts.lifecycle import RolloutState
from control_plane.store.rollups import Aggregate
from control_plane.telemetry.rollups import MINUTE
from runtime.histogram import BUCKETS_PER_DOUBLING, N_BUCKETS

if TYPE_CHECKING:
    from control_plane.api.server import App
    from control_plane.telemetry.rollups import Deltas

# `_created` series say when this process started counting: noise for these dashboards.
disable_created_metrics()

SCRAPE_CACHE_S = 10.0
MAX_SERIES = 200
MAX_ROLLOUTS = 100
ENDED_SHOWN = dt.timedelta(days=1)
OTHER = "other"
# Bucket bounds in µs: 2^3 .. 2^24 (8 µs .. 16.8 s), each a boundary of the device buckets.
LE_DOUBLINGS = tuple(range(3, 25))
_LE_INDEX = np.array([d * BUCKETS_PER_DOUBLING + 1 for d in LE_DOUBLINGS])
LE_SECONDS = tuple((2**d) / 1e6 for d in LE_DOUBLINGS)
COUNTED = ("inferences", "errors", "crashes", "fallbacks", "pipeline_firings")


class _Latency:
    """Cumulative per-label latency buckets, exported as one Prometheus histogram."""

    def __init__(self) -> None:
        self.buckets: dict[tuple[str, ...], np.ndarray] = {}
        self.sums: dict[tuple[str, ...], float] = {}

    def add(self, labels: tuple[str, ...], agg: Aggregate) -> None:
        counts = self.buckets.setdefault(labels, np.zeros(N_BUCKETS, np.float64))
        counts += agg.buckets
        self.sums[labels] = self.sums.get(labels, 0.0) + agg.latency_sum_ns / 1e9

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(
            "skiff_inference_latency_seconds",
            "Inference latency reported by devices, merged by this replica's roller.",
            labels=("model", "version", "variant"),
        )
        for labels, counts in sorted(self.buckets.items()):
            cumulative = np.cumsum(counts)
            below = [float(cumulative[i - 1]) for i in _LE_INDEX]  # buckets wholly under le
            pairs = [(repr(le), n) for le, n in zip(LE_SECONDS, below, strict=True)]
            pairs.append(("+Inf", float(cumulative[-1])))
            family.add_metric(list(labels), pairs, self.sums[labels])
        return family


class Metrics:
    """The Prometheus registry of one control-plane replica."""

    def __init__(self, app: App) -> None:
        self._app = app
        self.registry = CollectorRegistry(auto_describe=True)
        self._lock = threading.Lock()
        self._labels: set[tuple[str, str, str]] = set()
        self._counters = {
            name: Counter(
                f"skiff_{name}",
                f"{name.replace('_', ' ').capitalize()} reported by devices, merged by this "
                "replica's roller.",
                ("model", "version", "variant"),
                registry=self.registry,
            )
            for name in COUNTED
        }
        self._batches = Counter(
            "skiff_rollup_rounds",
            "Roll-up rounds this replica applied.",
            registry=self.registry,
        )
        self._latency = _Latency()
        self._cache: tuple[float, list] = (float("-inf"), [])
        self.registry.register(_ScrapeCollector(self))
        app.roller.observe(self.on_rolled)

    def _bounded(self, key) -> tuple[str, str, str]:
        labels = (key.model, str(key.version), key.variant)
        if labels not in self._labels:
            if len(self._labels) >= MAX_SERIES:
                return (OTHER, OTHER, OTHER)
            self._labels.add(labels)
        return labels

    def on_rolled(self, deltas: Deltas) -> None:
        """Count what one roll-up round merged (fleet-wide minute rows: each report once)."""
        with self._lock:
            self._batches.inc()
            for (resolution, _at, key), agg in deltas.items():
                if resolution != MINUTE or key.rollout:
                    continue
                labels = self._bounded(key)
                for name in COUNTED:
                    value = getattr(agg, name)
                    if value:
                        self._counters[name].labels(*labels).inc(value)
                if agg.latency_count:
                    self._latency.add(labels, agg)

    def render(self) -> tuple[bytes, str]:
        """Return the exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def scrape_families(self) -> list:
        """Return the gauges read from the store (cached for SCRAPE_CACHE_S)."""
        with self._lock:
            at, families = self._cache
            if time.monotonic() - at < SCRAPE_CACHE_S:
                return [*families, self._latency.family()]
        families = _fleet_families(self._app) + _rollout_families(self._app)
        with self._lock:
            self._cache = (time.monotonic(), families)
            return [*families, self._latency.family()]


class _ScrapeCollector:
    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self):
        yield from self._metrics.scrape_families()

    def describe(self):
        return []


def _fleet_families(app: App) -> list:
    from dashboards.web.data import fleet_summary

    summary = fleet_summary(app)
    devices = GaugeMetricFamily(
        "skiff_devices", "Enrolled devices by platform and state.", labels=("platform", "state")
    )
    for p in summary["platforms"]:
        for state in ("online", "offline", "revoked"):
            devices.add_metric([p["platform"], state], p[state])
    return [devices]


def _rollout_families(app: App) -> list:
    now = dt.datetime.now(dt.UTC)
    ended = (RolloutState.ROLLED_BACK, RolloutState.COMPLETED)
    shown = [
        r
        for r in app.rollouts.list(None)
        if r.state not in ended or _last_change(r) >= now - ENDED_SHOWN
    ][-MAX_ROLLOUTS:]
    state = GaugeMetricFamily(
        "skiff_rollout_state",
        "1 for a rollout's current state (in progress, or ended within a day).",
        labels=("rollout", "model", "version", "state"),
    )
    stage = GaugeMetricFamily(
        "skiff_rollout_stage_percent", "Percentage of the current stage.", labels=("rollout",)
    )
    counts = GaugeMetricFamily(
        "skiff_rollout_devices",
        "Devices of a rollout in progress, by status.",
        labels=("rollout", "status"),
    )
    for r in shown:
        for s in RolloutState:
            state.add_metric([r.id, r.model, str(r.version), s.value], float(r.state == s))
        stage.add_metric([r.id], float(r.stages[r.stage]))
        if r.state in ended:
            continue
        c = app.rollouts.counts(r)
        for status in ("selected", "in_stage", "synced", "installed", "failed"):
            counts.add_metric([r.id, status], getattr(c, status))
    return [state, stage, counts]


def _last_change(record) -> dt.datetime:
    return record.audit[-1].at if record.audit else record.stage_started_at
