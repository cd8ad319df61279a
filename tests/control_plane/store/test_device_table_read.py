"""A scope's device rows read as a table (`device_table`), on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt

import pytest

from control_plane.store.sql_store import SqlStore
from tests.control_plane.store.test_store_conformance import _insert_devices


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


def _device_rows(store) -> None:
    """Two windows, two cohorts, two configs; crash signals, time to first token, gaps."""
    from control_plane.store.rollup_aggregate import Aggregate
    from control_plane.store.rollup_records import DeviceDelta, DeviceKey
    from runtime.histogram import SCHEME, bucket_of

    now = dt.datetime(2026, 11, 23, 12, 0, 0, 250_000, tzinfo=dt.UTC)
    with store._engine.begin() as conn:
        _insert_devices(conn, range(4), now)
    windows = (dt.datetime(2026, 11, 1, tzinfo=dt.UTC), dt.datetime(2026, 11, 20, tzinfo=dt.UTC))
    deltas = {}
    for i in range(4):
        for w, window in enumerate(windows):
            for config in ("CPU", "OPENCL") if i % 2 else ("CPU",):
                agg = Aggregate(inferences=10 + i, errors=i, crashes=w)
                if i:
                    latency = 1000 * (i + 1) * (w + 2)
                    agg.add_histogram(
                        {
                            "scheme": SCHEME,
                            "count": 3,
                            "sum_ns": 3 * latency,
                            "min_ns": latency,
                            "max_ns": latency,
                            "buckets": [[bucket_of(latency), 3]],
                        }
                    )
                if i == 2:
                    agg.crash_signals["SIGSEGV"] = 2
                    agg.ttft = Aggregate()
                    agg.ttft.add_histogram(
                        {
                            "scheme": SCHEME,
                            "count": 1,
                            "sum_ns": 7_000_000,
                            "min_ns": 7_000_000,
                            "max_ns": 7_000_000,
                            "buckets": [[bucket_of(7_000_000), 1]],
                        }
                    )
                cohort = ("baseline", "candidate", "baseline", "outside")[i]
                key = DeviceKey(
                    "ro_1", window, cohort, "det", 1 + i % 2, "fp32", config, f"dev_{i}"
                )
                deltas[key] = DeviceDelta(f'{{"soc": "s{i}"}}', now, reports=2, aggregate=agg)
    store.apply_rollups([], {}, deltas)


def test_a_device_table_reads_only_the_cohorts_asked_for(store):
    _device_rows(store)
    since = dt.datetime(2026, 11, 10, tzinfo=dt.UTC)
    every = store.device_table("ro_1")
    assert set(every.cohort) == {"candidate", "baseline", "outside"}
    for cohorts in (("outside",), ("candidate", "baseline"), ("baseline", "outside", "candidate")):
        for filters in ({}, {"windows_since": since}):
            table = store.device_table("ro_1", cohorts=cohorts, **filters)
            whole = store.device_table("ro_1", **filters)
            assert len(table) > 0 and set(table.cohort) == set(cohorts) & set(whole.cohort)
            assert len(table) == sum(c in cohorts for c in whole.cohort)
    assert len(store.device_table("ro_1", cohorts=("nobody",))) == 0


def test_a_lean_device_table_reads_the_same_rows_without_what_a_health_view_skips(store):
    import numpy as np

    from control_plane.store.device_table import LEAN_SKIPS

    _device_rows(store)
    since = dt.datetime(2026, 11, 10, tzinfo=dt.UTC)
    for filters in (
        {},
        {"windows_since": since},
        {"windows_since": since, "cohorts": ("candidate", "baseline")},  # a health view's
        {"windows_before": since, "cohorts": ("baseline",)},
    ):
        full = store.device_table("ro_1", **filters)
        lean = store.device_table("ro_1", lean=True, **filters)
        assert len(full) == len(lean) > 0
        for name in LEAN_SKIPS:
            assert getattr(full, name) is not None and getattr(lean, name) is None
        for table in (full, lean):  # the ttft half too
            other = lean if table is full else full
            for name in (
                "window",
                "cohort",
                "config",
                "device_id",
                "device_class",
                "counters",
                "latency_count",
                "latency_sum_ns",
                "latency_min_ns",
                "latency_max_ns",
                "crash_signals",
                "hist_row",
                "hist_index",
                "hist_count",
            ):
                mine, theirs = getattr(table, name), getattr(other, name)
                assert mine.dtype == theirs.dtype, name
                assert mine.tolist() == theirs.tolist() or np.array_equal(
                    mine, theirs, equal_nan=True
                ), name
        assert (full.ttft is None) == (lean.ttft is None)
        if full.ttft is not None:
            assert full.ttft.latency_count.tolist() == lean.ttft.latency_count.tolist()
            assert full.ttft.hist_count.tolist() == lean.ttft.hist_count.tolist()
    # Seconds: a window start exactly, last seen within a millisecond (SQLite's is
    # computed from its Julian day).
    full = store.device_table("ro_1")
    assert set(full.window.tolist()) == {
        dt.datetime(2026, 11, d, tzinfo=dt.UTC).timestamp() for d in (1, 20)
    }
    seen = dt.datetime(2026, 11, 23, 12, 0, 0, 250_000, tzinfo=dt.UTC).timestamp()
    assert np.abs(full.last_seen - seen).max() < 1e-3
    # A lean table picks and joins rows as a full one does, and has no rows to give.
    lean = store.device_table("ro_1", lean=True)
    older = store.device_table("ro_1", lean=True, windows_before=since)
    joined = lean.concat(older).take(np.array([len(lean), 0]))
    assert joined.device_id.tolist() == [older.device_id[0], lean.device_id[0]]
    assert joined.model is None and joined.ttft is not None
    with pytest.raises(ValueError, match="lean"):
        lean.rows()
    with pytest.raises(ValueError, match="lean"):
        lean.concat(full)


def test_a_device_table_is_read_with_the_collector_held_and_resumed(store, monkeypatch):
    import contextlib
    import gc

    from control_plane.store import sql_device_table

    _device_rows(store)
    executed, table_of, seen = sql_device_table._executed, sql_device_table._table, []

    @contextlib.contextmanager
    def look_and_execute(*args):
        seen.append(("query", gc.isenabled()))  # not while the database runs it
        with executed(*args) as cursor:
            yield cursor

    def look_and_convert(*args):
        seen.append(("rows", gc.isenabled()))
        return table_of(*args)

    monkeypatch.setattr(sql_device_table, "_executed", look_and_execute)
    monkeypatch.setattr(sql_device_table, "_table", look_and_convert)
    was = gc.isenabled()
    gc.enable()
    try:
        table = store.device_table("ro_1", lean=True)
        assert seen == [("query", True), ("rows", False)] and gc.isenabled()
        # Rows without crashes share one read-only mapping, not a dict each.
        calm = [s for s in table.crash_signals if not s]
        assert len(calm) > 1 and all(s is calm[0] for s in calm)
        with pytest.raises(TypeError):
            calm[0]["SIGSEGV"] = 1
        assert {"SIGSEGV": 2} in list(table.crash_signals)
    finally:
        if not was:
            gc.disable()
