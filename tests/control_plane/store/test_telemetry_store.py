"""The telemetry store on SQLite and PostgreSQL: each batch applied once, counts follow."""

from __future__ import annotations

import datetime as dt
import threading

import pytest

from contract import errors
from contract.key_wrap import DeviceKeyPair
from control_plane.fleet.devices import Fleet
from control_plane.store.report_records import InstallRecord, ModelStatsRecord, ReportBatch
from control_plane.store.sql_store import SqlStore
from control_plane.telemetry import Telemetry
from runtime.histogram import LatencyHistogram

NOW = dt.datetime(2026, 11, 23, 12, 0, tzinfo=dt.UTC)


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


def enroll(store) -> str:
    fleet = Fleet(store, default_enroll_ttl_s=3600)
    made = fleet.create_enrollment_token(actor="t", attributes={})
    keys = DeviceKeyPair.generate()
    device, _ = fleet.enroll(token=made.token, attributes={}, public_keyset=keys.public_keyset())
    return device.id


def histogram(*latencies_us: float) -> dict:
    h = LatencyHistogram()
    for us in latencies_us:
        h.record_ns(int(us * 1000))
    return h.to_dict()


def batch(device: str, batch_id: str, *, installs=(), models=(), at=NOW) -> ReportBatch:
    return ReportBatch(device, batch_id, at, at - dt.timedelta(minutes=1), at, 0, models, installs)


def install(version: int, result: str, *, at=NOW, reason="") -> InstallRecord:
    return InstallRecord(at, "det", version, "fp32", "ro_1", result, reason)


def stats(version: int, *latencies_us: float, errors: int = 0) -> ModelStatsRecord:
    return ModelStatsRecord(
        "det",
        version,
        "fp32",
        "CPU/normal/t1/mem-normal",
        inferences=len(latencies_us) + errors,
        errors=errors,
        pipeline_firings=0,
        latency=histogram(*latencies_us),
    )


def test_a_batch_sent_twice_is_applied_once(store):
    device = enroll(store)
    first = batch(
        device, "batch-0001", installs=(install(1, "activated"),), models=(stats(1, 100),)
    )
    assert store.add_report(first) is True
    assert store.add_report(first) is False
    assert len(store.recent_installs(device, limit=10)) == 1
    assert len(store.device_stats(device, since=NOW - dt.timedelta(days=1))) == 1
    other = enroll(store)  # batch ids are per device: another device may use the same one
    assert store.add_report(batch(other, "batch-0001")) is True


def test_the_same_batch_racing_from_many_threads_lands_once(store):
    device = enroll(store)
    same = batch(device, "batch-race", installs=(install(1, "activated"),))
    results, barrier = [], threading.Barrier(4)

    def send():
        barrier.wait()
        results.append(store.add_report(same))

    threads = [threading.Thread(target=send) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [False, False, False, True]
    assert len(store.recent_installs(device, limit=10)) == 1


def test_install_outcomes_move_the_installed_and_failed_counts(store):
    a, b = enroll(store), enroll(store)
    store.add_report(batch(a, "a-000001", installs=(install(1, "activated"),)))
    store.add_report(batch(b, "b-000001", installs=(install(1, "activated"),)))
    later = NOW + dt.timedelta(minutes=5)
    store.add_report(
        batch(a, "a-000002", installs=(install(2, "failed", at=later, reason="self-test"),))
    )
    store.add_report(
        batch(
            b,
            "b-000002",
            installs=(
                install(1, "activated", at=later + dt.timedelta(seconds=1)),
                install(2, "rolled_back", at=later, reason="crashed"),
            ),
        )
    )
    assert store.count_model_states("det", 2, "fp32") == (0, 0, 2)
    assert store.count_model_states("det", 1, "fp32") == (0, 2, 0)
    # A later success clears the failure.
    store.add_report(batch(a, "a-000003", installs=(install(2, "activated", at=later),)))
    assert store.count_model_states("det", 2, "fp32") == (0, 1, 1)
    newest = store.recent_installs(b, limit=1)[0]
    assert (newest.version, newest.result) == (1, "activated")


def test_fleet_show_merges_a_devices_recent_histograms(store):
    device = enroll(store)
    store.add_report(batch(device, "m-000001", models=(stats(1, 100, 100, 100),)))
    later = NOW + dt.timedelta(minutes=1)
    store.add_report(batch(device, "m-000002", models=(stats(1, 1000, errors=2),), at=later))
    stale = NOW - dt.timedelta(days=2)  # outside the 24 h window
    store.add_report(batch(device, "m-000000", models=(stats(1, 50000),), at=stale))
    (merged,) = Telemetry(store).latency(device, now=later)
    assert (merged.inferences, merged.errors, merged.histogram.count) == (6, 2, 4)
    assert merged.histogram.max_ns == 1_000_000 and merged.since == NOW - dt.timedelta(minutes=1)
    assert 95 <= merged.histogram.quantile(0.5) <= 105


def test_an_outcome_older_than_the_recorded_one_changes_nothing(store):
    device = enroll(store)
    store.add_report(batch(device, "o-000001", installs=(install(5, "activated"),)))
    old = NOW - dt.timedelta(days=1)  # drained from a queue after the newer report
    store.add_report(batch(device, "o-000002", installs=(install(1, "activated", at=old),)))
    assert store.count_model_states("det", 5, "fp32") == (0, 1, 0)
    assert store.count_model_states("det", 1, "fp32") == (0, 0, 0)


def test_a_group_stores_each_batch_once_and_refuses_only_the_bad_ones(store):
    """One transaction for many batches (PostgreSQL: arrays and COPY): repeats within the
    group and from before are False, an unknown device fails its own batch only, and the
    stats come back exactly as sent, crash and fallback reports included."""
    a, b = enroll(store), enroll(store)
    crash = {"at": NOW.isoformat(), "config": "CPU", "reason": "signal", "signal": "SIGSEGV"}
    fallback = {"at": NOW.isoformat(), "from_config": "OPENCL", "to_config": "CPU", "reason": "x"}
    sent = ModelStatsRecord(
        "det",
        2,
        "int8",
        "CPU/normal/t1/mem-normal",
        inferences=12,
        errors=1,
        pipeline_firings=3,
        latency=histogram(100, 250, 250, 9000),
        crashes=(crash,),
        fallbacks=(fallback,),
    )
    assert store.add_report(batch(a, "batch-before")) is True
    group = [
        batch(a, "batch-g-1", models=(sent, stats(1, 5))),
        batch(a, "batch-g-1", models=(sent,)),  # the same batch twice in one group
        batch(a, "batch-before"),
        batch("dev_nobody", "batch-g-2"),
        batch(b, "batch-g-1", installs=(install(2, "failed", reason="self-test"),)),
    ]
    results = store.add_reports(group)
    assert results[:3] == [True, False, False] and results[4] is True
    assert isinstance(results[3], errors.NotFound) and "dev_nobody" in str(results[3])
    rows = store.device_stats(a, since=NOW - dt.timedelta(days=1))
    assert sorted((r.stats for r in rows), key=lambda s: s.version) == [stats(1, 5), sent]
    assert [i.result for i in store.recent_installs(b, limit=5)] == ["failed"]
