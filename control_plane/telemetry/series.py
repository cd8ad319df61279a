"""Time series read from the rollups: what the dashboard's latency and crash charts draw.

A version's series are one per variant, backend config and device class; a rollout's are
its candidate and baseline cohorts, side by side. Each point is one rollup bucket (a
minute for windows up to six hours, else an hour), with true quantiles of the merged
histogram, so a point's p95 is the p95 of every inference in that bucket.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from contract import errors
from control_plane.store.rollup_aggregate import Aggregate, llm_figures
from control_plane.store.rollup_records import RollupKey, RollupStore
from control_plane.telemetry.classes import class_values
from control_plane.telemetry.roller import HOUR, MINUTE, bucket_start, utcnow

# Longest window a chart may ask for: the hour rows' default retention.
MAX_WINDOW_H = 24 * 90
# Up to this window the points are minutes; past it, hours.
MINUTE_WINDOW_H = 6
# A chart with more lines than this is unreadable: the busiest series are drawn, and the
# rest are merged into one "other" line (the last of the MAX_SERIES).
MAX_SERIES = 8
# The fleet's health at a glance: each version's figures over this window.
HEALTH_WINDOW_H = 24


@dataclass(frozen=True)
class Series:
    """One line of a chart: its labels and one point per bucket that has data."""

    labels: dict
    points: tuple[dict, ...]

    def to_dict(self) -> dict:
        """Return the JSON-ready form (what the dashboard's API serves)."""
        return {"labels": self.labels, "points": list(self.points)}


def window(hours: float, now: dt.datetime | None = None) -> tuple[int, dt.datetime]:
    """Return (resolution_s, since) for a window of `hours`; InvalidArgument when out of range."""
    if not 0 < hours <= MAX_WINDOW_H:
        raise errors.InvalidArgument(f"hours must be above 0 and at most {MAX_WINDOW_H}")
    resolution = MINUTE if hours <= MINUTE_WINDOW_H else HOUR
    now = now or utcnow()
    return resolution, bucket_start(now - dt.timedelta(hours=hours), resolution)


def point(at: dt.datetime, agg: Aggregate) -> dict:
    """Return one chart point: counts, rates and latency quantiles of a bucket."""
    n = agg.inferences
    return {
        "at": at.replace(microsecond=0).isoformat().replace("+00:00", "Z"),
        "inferences": n,
        "errors": agg.errors,
        "crashes": agg.crashes,
        "crash_rate": agg.crashes / n if n else None,
        "error_rate": agg.errors / n if n else None,
        "p50_us": agg.quantile_us(0.50),
        "p95_us": agg.quantile_us(0.95),
        "p99_us": agg.quantile_us(0.99),
        # A language model's (its latency is decode time per token): tokens per second of
        # the median generation, time to first token, tokens generated.
        **(
            {**llm_figures(agg), "tokens_out": agg.tokens_out}
            if agg.ttft is not None or agg.tokens_out
            else {}
        ),
    }


def _collect(
    merged: dict[Hashable, Aggregate],
    label: Callable[[Hashable], dict],
    folded_label: Callable[[list[Hashable]], dict] = lambda keys: {},
) -> list[Series]:
    """Turn {(bucket, series key): aggregate} into series, the busiest first.

    Past MAX_SERIES, the busiest MAX_SERIES - 1 are kept and the rest merged bucket by
    bucket into one series labelled {"other": how many, **folded_label(their keys)} (its
    quantiles those of every inference it holds), so a fleet of many device classes
    still draws a readable chart.
    """
    lines: dict[Hashable, list[tuple[dt.datetime, Aggregate]]] = {}
    for (at, key), agg in merged.items():
        lines.setdefault(key, []).append((at, agg))
    # A line of install reports only (no inference: nothing to draw) is left out.
    drawn = [(key, pts) for key, pts in lines.items() if any(a.inferences for _, a in pts)]
    ranked = sorted(drawn, key=lambda kv: (-sum(a.inferences for _, a in kv[1]), kv[0]))
    shown = ranked if len(ranked) <= MAX_SERIES else ranked[: MAX_SERIES - 1]
    found = [Series(label(key), _points(pts)) for key, pts in shown]
    folded = ranked[len(shown) :]
    if folded:
        other: dict[dt.datetime, Aggregate] = {}
        for _, pts in folded:
            for at, agg in pts:
                other.setdefault(at, Aggregate()).merge(agg)
        labels = {"other": len(folded), **folded_label([key for key, _ in folded])}
        found.append(Series(labels, _points(list(other.items()))))
    return found


def _points(pts: list[tuple[dt.datetime, Aggregate]]) -> tuple[dict, ...]:
    return tuple(point(at, agg) for at, agg in sorted(pts, key=lambda p: p[0]))


def version_series(
    store: RollupStore, model: str, version: int, *, hours: float, now: dt.datetime | None = None
) -> list[Series]:
    """Return a version's series, one per variant, backend config and device class.

    The folded "other" series also says how many device classes it holds.
    """
    resolution, since = window(hours, now)

    def group(at: dt.datetime, key: RollupKey):
        return at, (key.variant, key.config, key.device_class)

    merged = store.merged_rollups(
        resolution_s=resolution, since=since, model=model, version=version, group=group
    )
    return _collect(
        merged,
        lambda k: {"variant": k[0], "config": k[1], "device_class": class_values(k[2])},
        lambda keys: {"device_classes": len({k[2] for k in keys})},
    )


def rollout_series(
    store: RollupStore, rollout_id: str, *, hours: float, now: dt.datetime | None = None
) -> list[Series]:
    """Return a rollout's candidate and baseline cohorts over the window (every slice)."""
    resolution, since = window(hours, now)

    def group(at: dt.datetime, key: RollupKey):
        return at, key.cohort

    merged = store.merged_rollups(
        resolution_s=resolution, since=since, rollout=rollout_id, group=group
    )
    return sorted(_collect(merged, lambda k: {"cohort": k}), key=lambda s: s.labels["cohort"])


def version_health(
    store: RollupStore, *, hours: float = HEALTH_WINDOW_H, now: dt.datetime | None = None
) -> tuple[dt.datetime, dict[tuple[str, int], dict]]:
    """Return (since, {(model, version): figures}) over the window, fleet-wide.

    Figures are `point`'s (inferences, errors, crashes, their rates, latency quantiles) of
    every inference each version reported in the window, all variants, configs and
    device classes pooled.
    """
    resolution, since = window(hours, now)
    merged = store.merged_rollups(
        resolution_s=resolution, since=since, group=lambda _at, key: (key.model, key.version)
    )
    return since, {key: point(since, agg) for key, agg in merged.items()}
