"""The charts' series: many device classes fold into one "other" line that keeps every
inference, install-only lines are left out, and a version's health pools its day."""

from __future__ import annotations

import datetime as dt
import json

import numpy as np

from control_plane.store.report_records import ModelStatsRecord
from control_plane.store.rollup_aggregate import Aggregate
from control_plane.store.rollup_records import RollupKey
from control_plane.telemetry import series
from control_plane.telemetry.roller import HOUR, MINUTE
from runtime.histogram import LatencyHistogram

NOW = dt.datetime(2026, 11, 26, 12, 0, tzinfo=dt.UTC)
AT = NOW - dt.timedelta(minutes=5)
CPU = "CPU/normal/t4/mem-normal"


def _agg(n: int, latency_ns: float = 1e6, crashes: int = 0) -> Aggregate:
    h = LatencyHistogram()
    if n:
        h.record_many_ns(np.full(n, latency_ns))
    agg = Aggregate()
    crashed = tuple({"signal": "SIGSEGV"} for _ in range(crashes))
    agg.add_stats(ModelStatsRecord("m", 1, "fp32", CPU, n, 0, 0, h.to_dict(), crashed))
    return agg


class Rollups:
    """merged_rollups over rows held in memory (the one method the series read)."""

    def __init__(self, rows: dict[RollupKey, Aggregate]) -> None:
        self.rows = rows

    def merged_rollups(self, *, resolution_s, since, model=None, version=None, group, **_):
        assert resolution_s in (MINUTE, HOUR) and since <= AT
        out: dict = {}
        for key, agg in self.rows.items():
            if (model, version) not in ((None, None), (key.model, key.version)):
                continue
            out.setdefault(group(AT, key), Aggregate()).merge(agg)
        return out


def _cls(i: int) -> str:
    return json.dumps({"device_model": f"Board {i:02d}"}, sort_keys=True)


def test_forty_classes_fold_into_seven_lines_and_other():
    rows = {RollupKey("m", 1, "fp32", CPU, _cls(i)): _agg(100 + i) for i in range(40)}
    rows[RollupKey("m", 1, "fp32", "", _cls(0))] = _agg(0)  # an install report only
    rows[RollupKey("other-model", 1, "fp32", CPU, _cls(0))] = _agg(5)
    found = series.version_series(Rollups(rows), "m", 1, hours=1, now=NOW)
    assert len(found) == series.MAX_SERIES == 8
    assert [s.labels["device_class"]["device_model"] for s in found[:7]] == [
        f"Board {i:02d}" for i in range(39, 32, -1)
    ]
    assert found[-1].labels == {"other": 33, "device_classes": 33}
    (point,) = found[-1].points
    assert point["inferences"] == sum(100 + i for i in range(33))
    assert point["p95_us"] is not None


def test_few_lines_are_all_drawn():
    rows = {RollupKey("m", 1, "fp32", CPU, _cls(i)): _agg(10) for i in range(8)}
    found = series.version_series(Rollups(rows), "m", 1, hours=1, now=NOW)
    assert len(found) == 8 and not any("other" in s.labels for s in found)


def test_a_versions_health_pools_every_class_of_its_day():
    rows = {
        RollupKey("m", 1, "fp32", CPU, _cls(0)): _agg(90, 1e6),
        RollupKey("m", 1, "int8", CPU, _cls(1)): _agg(10, 9e6, crashes=2),
        RollupKey("m", 2, "fp32", CPU, _cls(0)): _agg(4),
    }
    since, health = series.version_health(Rollups(rows), now=NOW)
    assert since <= NOW - dt.timedelta(hours=series.HEALTH_WINDOW_H)
    assert set(health) == {("m", 1), ("m", 2)}
    v1 = health["m", 1]
    assert (v1["inferences"], v1["crashes"], v1["crash_rate"]) == (100, 2, 0.02)
    # p95 of the pooled inferences: past the 90 fast ones, among the 10 slow.
    assert v1["p95_us"] > 5_000


def test_a_page_size_that_is_not_ascii_digits_gets_the_default():
    from dashboards.web.pages import _count

    assert _count("²", 50, 1000) == 50  # "²".isdigit() is true; int("²") refuses it
    assert _count("٣", 50, 1000) == 50
    assert _count("20", 50, 1000) == 20
    assert _count("0", 50, 1000) == 50 and _count("5000", 50, 1000) == 50
