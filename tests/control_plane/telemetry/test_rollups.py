"""The roller on SQLite and PostgreSQL: exact merges, each batch once, cohorts, retention."""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading

import numpy as np
import pytest

from contract.key_wrap import DeviceKeyPair
from control_plane.fleet.devices import Fleet
from control_plane.rollouts.resolver import Resolver, Snapshot
from control_plane.store.report_records import InstallRecord, ModelStatsRecord, ReportBatch
from control_plane.store.rollouts import RolloutRecord
from control_plane.store.sql_store import SqlStore
from control_plane.telemetry.classes import parse_device_class
from control_plane.telemetry.ingest import ReportWriter
from control_plane.telemetry.roller import HOUR, MINUTE, Retention, Roller
from runtime.histogram import LatencyHistogram

NOW = dt.datetime(2026, 11, 23, 12, 0, 30, tzinfo=dt.UTC)
CLASS = parse_device_class("soc,device_model,os_version:major")
CPU = "CPU/normal/t1/mem-normal"
DAYS_2, DAYS_7, DAYS_32 = dt.timedelta(days=2), dt.timedelta(days=7), dt.timedelta(days=32)


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


class FixedResolver:
    """The resolver's one method the roller uses, over a fixed set of rollouts."""

    def __init__(self, *records: RolloutRecord) -> None:
        live = Resolver(store=None)
        self._snapshot = Snapshot(1, [live.live(r) for r in records])

    def snapshot(self) -> Snapshot:
        return self._snapshot


def rollout(rid="ro_1", version=2, selector="soc=sm8450", state="active") -> RolloutRecord:
    return RolloutRecord(
        rid, "det", version, "fp32", selector, (100.0,), 0, state, 0, 0, NOW, "t", NOW
    )


def enroll(store, **attrs) -> str:
    # Enrolled well before NOW: reports are credited only with time since enrollment.
    fleet = Fleet(store, default_enroll_ttl_s=3600, clock=lambda: NOW - DAYS_7)
    made = fleet.create_enrollment_token(actor="t", attributes={})
    keys = DeviceKeyPair.generate()
    device, _ = fleet.enroll(token=made.token, attributes=attrs, public_keyset=keys.public_keyset())
    return device.id


def stats(version, latencies_us, *, crashes=0, errors=0, model="det") -> ModelStatsRecord:
    h = LatencyHistogram()
    h.record_many_ns(np.asarray(latencies_us, dtype=np.float64) * 1000)
    crash = {"at": NOW.isoformat(), "config": CPU, "reason": "signal", "signal": "SIGSEGV"}
    return ModelStatsRecord(
        model,
        version,
        "fp32",
        CPU,
        inferences=len(latencies_us) + errors,
        errors=errors,
        pipeline_firings=0,
        latency=h.to_dict(),
        crashes=(crash,) * crashes,
    )


def report(store, device, batch_id, *models, at=NOW, installs=()) -> None:
    start = at - dt.timedelta(minutes=1)
    assert store.add_report(ReportBatch(device, batch_id, at, start, at, 0, models, installs))


def roller(store, *rollouts, retention=None) -> Roller:
    # Straggler age 0: batches are found in the database (as after a restart), not handed
    # over by the writer.
    return Roller(
        store,
        FixedResolver(*rollouts),
        CLASS,
        retention=retention or Retention(),
        clock=lambda: NOW + dt.timedelta(seconds=1),
        straggler_age=dt.timedelta(0),
    )


def fleet_wide(store, resolution=HOUR, group=lambda _at, key: key):
    since = NOW - dt.timedelta(days=2)
    return store.merged_rollups(resolution_s=resolution, since=since, group=group)


def test_rollups_merge_histograms_exactly(store):
    a = enroll(store, soc="sm8450", device_model="Pixel 7", os_version="14.1")
    b = enroll(store, soc="sm8450", device_model="Pixel 7", os_version="14.2")
    rng = np.random.default_rng(1)
    samples = [rng.lognormal(8, 0.5, 300) for _ in range(3)]
    report(store, a, "batch-a-1", stats(1, samples[0], errors=2, crashes=1))
    report(store, a, "batch-a-2", stats(1, samples[1]), at=NOW - dt.timedelta(minutes=5))
    report(store, b, "batch-b-1", stats(1, samples[2]))
    assert roller(store).roll() == 3

    rows = fleet_wide(store)
    assert len(rows) == 1  # one class: os_version 14.1 and 14.2 are both major 14
    ((key, agg),) = rows.items()
    assert key.device_class == '{"device_model": "Pixel 7", "os_version": "14", "soc": "sm8450"}'
    exact = LatencyHistogram()
    exact.record_many_ns(np.concatenate(samples) * 1000)
    assert agg.latency_count == exact.count == 900
    assert agg.buckets.tolist() == exact.counts.tolist()
    assert (agg.latency_min_ns, agg.latency_max_ns) == (exact.min_ns, exact.max_ns)
    for p in (50, 95, 99):  # true quantiles of the merged histogram
        assert agg.quantile_us(p / 100) == pytest.approx(exact.quantile(p / 100))
    assert (agg.inferences, agg.errors, agg.crashes) == (902, 2, 1)
    assert dict(agg.crash_signals) == {"SIGSEGV": 1}
    minutes = fleet_wide(store, MINUTE, group=lambda at, _k: at)
    assert sorted(at.minute for at in minutes) == [0, 55]  # periods end 12:00:30 and 11:55:30
    assert sum(m.latency_count for m in minutes.values()) == 900


def test_each_batch_is_rolled_once_even_with_racing_rollers(store):
    devices = [enroll(store, soc="s") for _ in range(4)]
    for i, device in enumerate(devices):
        for j in range(5):
            report(store, device, f"batch-{i}-{j:04d}", stats(1, [1000.0] * 10))
    barrier = threading.Barrier(3)
    rolled = []

    def run():
        r = roller(store)
        barrier.wait()
        rolled.append(r.roll())

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(rolled) == 20
    assert roller(store).roll() == 0
    (agg,) = fleet_wide(store).values()
    assert agg.inferences == agg.latency_count == 200


def released(rid="ro_0", version=1) -> RolloutRecord:
    """A completed rollout of `version` to every device: what they run without another."""
    return dataclasses.replace(
        rollout(rid, version, selector="", state="completed"), created_at=NOW - DAYS_2
    )


def half(rid="ro_1", **fields) -> RolloutRecord:
    """The v2 rollout at a 50% stage."""
    return dataclasses.replace(rollout(rid), stages=(50.0, 100.0), **fields)


def split(store, record: RolloutRecord, n: int = 2, **attrs) -> tuple[list[str], list[str]]:
    """Enroll devices until `n` are in the rollout's stage and `n` are not."""
    live = Resolver(store=None).live(record)
    inside, outside = [], []
    while len(inside) < n or len(outside) < n:
        device = enroll(store, **attrs)
        (inside if live.includes(device) else outside).append(device)
    return inside[:n], outside[:n]


def test_cohorts_are_by_assignment_not_by_what_a_device_reports(store):
    """One device in the stage (candidate), one not (baseline). What a device says it
    runs never puts it in a cohort: a device not in the stage reporting the new version,
    one in the stage still reporting the old one, and an unselected device reporting the
    new one all land outside, counted and never judged."""
    record = half()
    (new, stale), (old, liar) = split(store, record, soc="sm8450")
    other = enroll(store, soc="mt6789")  # not selected
    report(store, new, "batch-new-1", stats(2, [2000.0] * 4, crashes=1))
    report(store, old, "batch-old-1", stats(1, [1000.0] * 6))
    report(store, liar, "batch-liar-1", stats(2, [9e6] * 100_000))
    report(store, stale, "batch-stale-1", stats(1, [1000.0] * 7))
    report(store, other, "batch-oth-1", stats(2, [3000.0] * 8))
    report(store, other, "batch-oth-2", stats(1, [3000.0] * 8))
    installs = (InstallRecord(NOW, "det", 2, "fp32", "ro_1", "failed", "self-test"),)
    report(store, stale, "batch-stale-2", installs=installs)
    roller(store, released(), record).roll()

    cohorts = store.merged_rollups(
        resolution_s=HOUR,
        since=NOW - dt.timedelta(hours=1),
        rollout="ro_1",
        group=lambda _at, k: (k.cohort, k.version),
    )
    assert cohorts.keys() == {("candidate", 2), ("baseline", 1)}
    assert cohorts["candidate", 2].inferences == 4
    assert cohorts["candidate", 2].crashes == 1
    # The failed install of version 2 is the candidate's: that device was assigned it.
    assert cohorts["candidate", 2].installs_failed == 1
    assert cohorts["baseline", 1].inferences == 6
    rows = store.device_rollups("ro_1")
    members = {(r.key.cohort, r.key.device_id) for r in rows}
    assert members == {
        ("candidate", new),
        ("candidate", stale),  # its failed install
        ("baseline", old),
        ("outside", liar),  # not in the stage, reporting v2
        ("outside", stale),  # in the stage, still reporting v1
        ("outside", other),  # not selected, reporting v2 (its v1 is none of ro_1's)
    }
    outside = [r for r in rows if r.key.cohort == "outside"]
    assert sum(r.reports for r in outside) == 3
    assert sum(r.counters["inferences"] for r in outside) == 100_000 + 7 + 8
    # Fleet-wide rows hold everyone's reports; a device row per device and version.
    assert sum(a.inferences for a in fleet_wide(store).values()) == 100_000 + 33
    fleet = store.device_rollups("", model="det", version=2)
    assert {r.key.device_id for r in fleet} == {new, liar, other}


def test_a_report_from_before_the_stage_counts_by_the_stage_it_was_made_in(store):
    """A batch rolled after the stage moved on (queued through an outage) counts by the
    stage then: a device running v1 before the 100% stage reached it was the baseline."""
    staged = NOW - dt.timedelta(hours=1)
    record = half(stage=1, stage_started_at=staged, created_at=NOW - dt.timedelta(hours=3))
    _, (old,) = split(store, half(), n=1, soc="sm8450")  # not in the 50% stage before
    before, during = staged - dt.timedelta(minutes=5), NOW
    report(store, old, "batch-before-1", stats(1, [1000.0] * 5), at=before)
    report(store, old, "batch-during-1", stats(2, [1000.0] * 3), at=during)
    report(store, old, "batch-during-2", stats(1, [1000.0] * 2), at=during)
    roller(store, released(), record).roll()
    rows = {(r.key.cohort, r.key.window, r.key.version): r for r in store.device_rollups("ro_1")}
    assert rows.keys() == {
        ("baseline", record.created_at, 1),  # before the current window
        ("candidate", staged, 2),
        ("outside", staged, 1),  # in the stage now, still on v1
    }
    assert rows["baseline", record.created_at, 1].counters["inferences"] == 5


def test_retention_drops_old_minutes_raw_batches_and_hours(store):
    device = enroll(store, soc="s")
    report(store, device, "batch-old-0001", stats(1, [1000.0]), at=NOW - dt.timedelta(hours=3))
    report(store, device, "batch-new-0001", stats(1, [1000.0]))
    short = Retention(
        minute=dt.timedelta(hours=2), hour=dt.timedelta(days=1), raw=dt.timedelta(hours=1)
    )
    r = roller(store, retention=short)
    r.roll()  # the 3-hour-old batch lands in its hour bucket only: its minute is past keeping
    assert sum(a.latency_count for a in fleet_wide(store, MINUTE).values()) == 1
    assert sum(a.latency_count for a in fleet_wide(store, HOUR).values()) == 2
    report(store, device, "batch-late-001", stats(1, [1000.0]), at=NOW - dt.timedelta(hours=2))
    gone = r.prune()
    assert gone["model_stats"] == 1  # the rolled old one's; the late one waits for the roller
    # Batch ids outlive the stats: a batch sent again (its answer was lost) days later is
    # still known, and not counted twice.
    assert gone["batches"] == 0
    old = ReportBatch(device, "batch-old-0001", NOW, NOW, NOW, 0, (stats(1, [1000.0]),), ())
    assert store.add_report(old) is False
    r.roll()
    assert sum(a.latency_count for a in fleet_wide(store, HOUR).values()) == 3
    later = Roller(store, FixedResolver(), CLASS, retention=short, clock=lambda: NOW + DAYS_2)
    assert later.prune()["rollups"] >= 3
    assert fleet_wide(store, HOUR) == {}
    month = Roller(store, FixedResolver(), CLASS, retention=short, clock=lambda: NOW + DAYS_32)
    assert month.prune()["batches"] == 3


def test_batches_handed_over_by_the_writer_are_rolled_without_rereading(store):
    device = enroll(store, soc="s")
    r = roller(store)
    writer = ReportWriter(store, on_stored=r.offer)
    try:
        minute = dt.timedelta(minutes=1)
        sent = [  # contiguous periods, as a device reports them
            ReportBatch(
                device,
                f"batch-w-{i:04d}",
                NOW,
                NOW - (3 - i) * minute,
                NOW - (2 - i) * minute,
                0,
                (stats(1, [500.0]),),
                (),
            )
            for i in range(3)
        ]
        futures = [writer.submit(b) for b in [*sent, sent[0]]]
        assert [f.result(timeout=10) for f in futures] == [True, True, True, False]
    finally:
        writer.close()
    fresh = Roller(store, FixedResolver(), CLASS, clock=lambda: NOW)  # no stragglers yet
    assert fresh.roll() == 0
    assert r.roll() == 3  # from memory
    assert r.roll() == 0
    (agg,) = fleet_wide(store).values()
    assert agg.inferences == 3
    # A busy replica still rolls what it did not hand over in memory (here: a batch
    # stored before a restart), in the same call.
    report(store, device, "batch-restart-01", stats(1, [500.0]))
    writer = ReportWriter(store, on_stored=r.offer)
    try:
        # After the writer's last period (it checks periods); received after its end.
        second = dt.timedelta(seconds=1)
        fresh = ReportBatch(
            device,
            "batch-fresh-001",
            NOW + 2 * second,
            NOW,
            NOW + second,
            0,
            (stats(1, [5.0]),),
            (),
        )
        assert writer.submit(fresh).result(10)
    finally:
        writer.close()
    assert r.roll() == 2


def test_a_roll_takes_what_was_waiting_and_leaves_later_batches_to_the_next(store):
    """A roll chasing batches that arrive while it runs does ever smaller rounds, each
    costing a merge of every row it touches: on PostgreSQL it ran for seconds and took a
    third of Report's throughput. Later batches wait for the next roll, in one round."""
    device = enroll(store, soc="s")
    start = NOW - dt.timedelta(minutes=1)

    def stored(prefix: str, n: int) -> list[ReportBatch]:
        batches = [
            ReportBatch(device, f"{prefix}-{i:04d}", NOW, start, NOW, 0, (stats(1, [5.0]),), ())
            for i in range(n)
        ]
        assert store.add_reports(batches) == [True] * n
        return batches

    r = Roller(store, FixedResolver(), CLASS, clock=lambda: NOW, batches_per_round=2)
    rounds: list[int] = []
    later = iter([stored("batch-late-a", 3), stored("batch-late-b", 3)])

    def arrive(deltas) -> None:  # after each round, more batches have come in
        rounds.append(sum(agg.inferences for (res, _, _), agg in deltas.items() if res == HOUR))
        r.offer(next(later, []))

    r.observe(arrive)
    r.offer(stored("batch-first", 5))
    assert r.roll() == 5 and rounds == [2, 2, 1]
    assert r.roll() == 6  # what came in meanwhile, in the next call
    assert rounds[3:] == [2, 2, 2]
