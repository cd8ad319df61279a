"""Prometheus metrics on the dashboard's port (`/metrics`, a viewer token as bearer).

Two kinds, each with bounded label sets:
- gauges read at scrape time (at most every SCRAPE_CACHE_S): devices by platform and
  state, and per rollout its state, stage and device counts (rollouts in progress, and
  those that ended in the last day);
- counters and a latency histogram this replica adds to as its roller merges device
  reports (sum them over replicas: each batch is rolled by exactly one), fleet-wide by
  model, version, variant, backend config and device class, and per rollout by cohort
  (candidate or baseline) and slice, the figures guardrails judge (for a language model,
  the latency histogram is decode time per token; its time to first token is
  `skiff_llm_ttft_seconds`, its tokens `skiff_tokens_in`/`skiff_tokens_out`);
- and per rollout the slices guardrails or operators rolled back.

Devices say what they run and what they are, so label values come from outside. Label
sets are bounded so that no device, and no fleet of many device models, can crowd out the
series of a new version: only published versions get labels of their own (the rest are
all "other"); each version gets at most PER_VERSION (config, class) pairs and each rollout
PER_ROLLOUT (cohort, slice) pairs, beyond which they pool as "other" under the version's
or rollout's own labels; MAX_SERIES and MAX_ROLLOUT_SERIES cap the whole; label values
are cut at MAX_LABEL characters.

The latency histogram's `le` bounds are boundaries of the devices' own histogram buckets
(powers of two microseconds), so converting is exact.
"""

from __future__ import annotations

import collections
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
from control_plane.store.rollup_aggregate import Aggregate
from control_plane.telemetry.classes import class_values, parse_dimension
from control_plane.telemetry.roller import MINUTE
from runtime.histogram import BUCKETS_PER_DOUBLING, N_BUCKETS

if TYPE_CHECKING:
    from control_plane.app import App
    from control_plane.telemetry.roller import Deltas

# `_created` series say when this process started counting: noise for these dashboards.
disable_created_metrics()

SCRAPE_CACHE_S = 10.0
MAX_SERIES = 2000
MAX_ROLLOUT_SERIES = 1000
PER_VERSION = 100
PER_ROLLOUT = 64
MAX_LABEL = 80
PUBLISHED_REFRESH_S = 30.0
MAX_ROLLOUTS = 100
ENDED_SHOWN = dt.timedelta(days=1)
OTHER = "other"
# Bucket bounds in µs: 2^3 .. 2^24 (8 µs .. 16.8 s), each a boundary of the device buckets.
LE_DOUBLINGS = tuple(range(3, 25))
_LE_INDEX = np.array([d * BUCKETS_PER_DOUBLING + 1 for d in LE_DOUBLINGS])
LE_SECONDS = tuple((2**d) / 1e6 for d in LE_DOUBLINGS)
# A language model's generations count as inferences, and its latency is decode time per
# token; its tokens, cancellations and time to first token have series of their own.
COUNTED = (
    "inferences",
    "errors",
    "crashes",
    "fallbacks",
    "pipeline_firings",
    "tokens_in",
    "tokens_out",
    "cancellations",
)
LABELS = ("model", "version", "variant", "config", "device_class")
ROLLOUT_LABELS = ("rollout", "cohort", "slice")
ROLLOUT_COUNTED = ("inferences", "errors", "crashes", "fallbacks", "tokens_out")


class _Latency:
    """Cumulative per-label latency buckets, exported as one Prometheus histogram."""

    def __init__(self, name: str, doc: str, labels: tuple[str, ...]) -> None:
        self.name, self.doc, self.labels = name, doc, labels
        self.buckets: dict[tuple[str, ...], np.ndarray] = {}
        self.sums: dict[tuple[str, ...], float] = {}

    def add(self, labels: tuple[str, ...], agg: Aggregate) -> None:
        counts = self.buckets.setdefault(labels, np.zeros(N_BUCKETS, np.float64))
        counts += agg.buckets
        self.sums[labels] = self.sums.get(labels, 0.0) + agg.latency_sum_ns / 1e9

    def family(self) -> HistogramMetricFamily:
        family = HistogramMetricFamily(self.name, self.doc, labels=self.labels)
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
        self._labels: set[tuple[str, ...]] = set()
        self._rollout_labels: set[tuple[str, ...]] = set()
        self._per_owner: collections.Counter = collections.Counter()  # version / rollout
        self._published: dict[str, int] = {}  # model -> latest version
        self._published_at = float("-inf")
        by = "reported by devices, merged by this replica's roller"
        self._counters = {
            name: Counter(
                f"skiff_{name}",
                f"{name.replace('_', ' ').capitalize()} {by}.",
                LABELS,
                registry=self.registry,
            )
            for name in COUNTED
        }
        self._rollout_counters = {
            name: Counter(
                f"skiff_rollout_{name}",
                f"{name.capitalize()} of a rollout's cohort and slice, {by}.",
                ROLLOUT_LABELS,
                registry=self.registry,
            )
            for name in ROLLOUT_COUNTED
        }
        self._batches = Counter(
            "skiff_rollup_rounds",
            "Roll-up rounds this replica applied.",
            registry=self.registry,
        )
        self._latency = _Latency(
            "skiff_inference_latency_seconds", f"Inference latency {by}.", LABELS
        )
        self._rollout_latency = _Latency(
            "skiff_rollout_latency_seconds",
            f"Inference latency of a rollout's cohort and slice, {by}.",
            ROLLOUT_LABELS,
        )
        self._ttft = _Latency(
            "skiff_llm_ttft_seconds", f"A language model's time to first token {by}.", LABELS
        )
        self._rollout_ttft = _Latency(
            "skiff_rollout_llm_ttft_seconds",
            f"Time to first token of a rollout's cohort and slice, {by}.",
            ROLLOUT_LABELS,
        )
        self._cache: tuple[float, list] = (float("-inf"), [])
        self.registry.register(_ScrapeCollector(self))
        app.roller.observe(self.on_rolled)

    def _bounded(self, key) -> tuple[str, ...]:
        """Return the labels a rollup key is counted under (see the module docstring)."""
        if key.rollout:
            owner = (key.rollout,)
            detail = (key.cohort, _cut(slice_label(key.device_class)))
            seen, most, each = self._rollout_labels, MAX_ROLLOUT_SERIES, PER_ROLLOUT
        else:
            if not 1 <= key.version <= self._published.get(key.model, 0):
                return (OTHER,) * len(LABELS)
            owner = (key.model, str(key.version), key.variant)  # all validated names
            detail = (_cut(key.config), _cut(class_label(key.device_class)))
            seen, most, each = self._labels, MAX_SERIES, PER_VERSION
        pooled = owner + (OTHER,) * len(detail)
        # The last place of each owner, and of all, is kept for the owner's pool.
        for labels, room in ((owner + detail, 1), (pooled, 0)):
            if labels in seen:
                return labels
            if self._per_owner[owner] < each - room and len(seen) < most - room:
                seen.add(labels)
                self._per_owner[owner] += 1
                return labels
        return (OTHER,) * len(pooled)

    def _refresh_published(self, deltas: Deltas) -> None:
        """Re-read the published versions when a report names one not known yet."""
        fresh = time.monotonic() - self._published_at < PUBLISHED_REFRESH_S
        unknown = any(
            not key.rollout and key.version > self._published.get(key.model, 0)
            for (_res, _at, key) in deltas
        )
        # Re-read every PUBLISHED_REFRESH_S, or sooner (at most once a second) when a
        # report names a version newer than the last read.
        if (fresh and not unknown) or time.monotonic() - self._published_at < 1.0:
            return
        self._published_at = time.monotonic()
        published, after = {}, ""
        while True:  # page by page: a registry of many models is read in bounded pieces
            page = self._app.registry.list_models(after=after, limit=500)
            published.update({m.name: m.latest_version for m in page})
            if len(page) < 500:
                break
            after = page[-1].name
        self._published = published

    def on_rolled(self, deltas: Deltas) -> None:
        """Count what one roll-up round merged (minute rows: each report once)."""
        self._refresh_published(deltas)
        with self._lock:
            self._batches.inc()
            for (resolution, _at, key), agg in deltas.items():
                if resolution != MINUTE:
                    continue
                labels = self._bounded(key)
                counters = self._rollout_counters if key.rollout else self._counters
                for name, counter in counters.items():
                    value = getattr(agg, name)
                    if value:
                        counter.labels(*labels).inc(value)
                if agg.latency_count:
                    (self._rollout_latency if key.rollout else self._latency).add(labels, agg)
                if agg.ttft is not None and agg.ttft.latency_count:
                    (self._rollout_ttft if key.rollout else self._ttft).add(labels, agg.ttft)

    def render(self) -> tuple[bytes, str]:
        """Return the exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def scrape_families(self) -> list:
        """Return the gauges read from the store (cached for SCRAPE_CACHE_S)."""
        with self._lock:
            at, families = self._cache
            if time.monotonic() - at < SCRAPE_CACHE_S:
                return [*families, *self._histograms()]
        families = _fleet_families(self._app) + _rollout_families(self._app)
        with self._lock:
            self._cache = (time.monotonic(), families)
            return [*families, *self._histograms()]

    def _histograms(self) -> list:
        kept = (self._latency, self._rollout_latency, self._ttft, self._rollout_ttft)
        return [h.family() for h in kept]


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
    slices = GaugeMetricFamily(
        "skiff_rollout_slice_rolled_back",
        "1 for each slice of a sliced rollout that is rolled back (by a guardrail or an "
        "operator); readmitted slices are gone.",
        labels=("rollout", "slice"),
    )
    for r in shown:
        for s in RolloutState:
            state.add_metric([r.id, r.model, str(r.version), s.value], float(r.state == s))
        stage.add_metric([r.id], float(r.stages[r.stage]))
        for value in sorted(r.rolled_back_slices()):
            slices.add_metric([r.id, f"{parse_dimension(r.slice_by).name}={value}"], 1.0)
        if r.state in ended:
            continue
        c = app.rollouts.counts(r)
        statuses = (
            "selected",
            "in_stage",
            "synced",
            "installed",
            "failed",
            "ineligible",
            "waiting",
        )
        for status in statuses:
            counts.add_metric([r.id, status], getattr(c, status))
    return [state, stage, counts, slices]


def _cut(value: str) -> str:
    return value if len(value) <= MAX_LABEL else value[: MAX_LABEL - 1] + "…"


def class_label(device_class: str) -> str:
    """Return a stored device class as a label: `soc=sm8450, os_version=14`, sorted."""
    return ", ".join(f"{k}={v}" for k, v in sorted(class_values(device_class).items()))


def slice_label(slice_class: str) -> str:
    """Return a rollout row's slice as a label: `soc=sm8450`, or `all` if unsliced."""
    return class_label(slice_class) or "all"


def _last_change(record) -> dt.datetime:
    return record.audit[-1].at if record.audit else record.stage_started_at
