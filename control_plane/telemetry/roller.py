"""The roller: merges stored telemetry batches into per-minute and per-hour rollups.

Ingestion (a device's Report) only stores the raw batch. A background roller on every
replica then, every few seconds, takes the batches not rolled up yet, groups their stats
by model, version, variant, backend config and device class (control_plane.telemetry.
classes), and adds them into one row per group and time bucket: 1-minute buckets (kept
48 hours by default) and 1-hour buckets (kept 90 days). Each batch is rolled exactly once:
the rows and the batch's `rolled` flag change in one transaction, which fails as a whole
when another replica's roller took the batch first.

For guardrails, the same stats are also added to rows of each live rollout they concern,
by the cohort the device is in by *assignment*: the **candidate** cohort (devices assigned
the rollout's version under it, reporting it) or the **baseline** cohort (devices it
selects but does not include yet, reporting what they are assigned without it); anything
else is **outside**: kept and counted, never judged. Assignment is the rollouts' business,
so they place each report (`Cohorts`, served by control_plane.rollouts.resolver) and the
roller adds it where it is placed. Guardrails judge each device's own figures
(control_plane.telemetry.robust), so besides rows over time the roller keeps one row per
device and backend config: per rollout, cohort and guardrail window, and fleet-wide per
model version (backend recommendations).

A batch counts in the buckets its period ends in; install outcomes in the buckets of
their own time.
"""

from __future__ import annotations

import collections
import datetime as dt
import functools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from control_plane.store.fleet import FleetStore
from control_plane.store.report_records import MAX_REPORT_AGE, ModelStatsRecord, ReportBatch
from control_plane.store.rollup_aggregate import Aggregate, StatsDelta
from control_plane.store.rollup_records import (
    EPOCH,
    FLEET,
    OUTSIDE,
    DeviceDelta,
    DeviceKey,
    PendingBatch,
    RollupKey,
    RollupStore,
)
from control_plane.telemetry.classes import DeviceClass

log = logging.getLogger(__name__)

MINUTE, HOUR, DAY = 60, 3600, 86_400
RESOLUTIONS = (MINUTE, HOUR, DAY)
BATCHES_PER_ROUND = 2000
PRUNE_EVERY_S = 600.0
# Batches this replica stored wait in memory for its roller (no re-read, no JSON
# decoding); any the roller misses (a restart, a full queue, a lost race) are found in
# the database once they are this old.
STRAGGLER_AGE = dt.timedelta(seconds=60)
MAX_FRESH = 50_000


@dataclass(frozen=True)
class Retention:
    """How long each kind of telemetry is kept."""

    minute: dt.timedelta = dt.timedelta(hours=48)
    hour: dt.timedelta = dt.timedelta(days=90)
    day: dt.timedelta = dt.timedelta(days=400)
    raw: dt.timedelta = dt.timedelta(hours=48)
    # Device rows of a rollout (its whole-rollout baseline included) and fleet-wide ones
    # (backend recommendations read 7 days), kept while their device goes on reporting.
    devices: dt.timedelta = dt.timedelta(days=7)

    def of(self, resolution_s: int) -> dt.timedelta:
        """Return how long rows of a resolution are kept."""
        return {MINUTE: self.minute, HOUR: self.hour, DAY: self.day}[resolution_s]


def bucket_start(at: dt.datetime, resolution_s: int) -> dt.datetime:
    """Return the start of the `resolution_s` bucket holding `at` (aware UTC)."""
    seconds = int(at.timestamp()) // resolution_s * resolution_s
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def utcnow() -> dt.datetime:
    """Return the current time, aware UTC."""
    return dt.datetime.now(dt.UTC)


# What one round adds: (resolution, bucket start, key) -> the aggregate merged in.
Deltas = dict[tuple[int, dt.datetime, RollupKey], Aggregate]


@dataclass(frozen=True)
class Placement:
    """Where one report counts in one live rollout's rows, as the rollouts place it."""

    rollout: str  # the rollout's id
    cohort: str  # CANDIDATE, BASELINE or OUTSIDE (store.rollup_records)
    device_class: str  # the class its rows keep: {slice attribute: value} as JSON, or "{}"
    window: dt.datetime  # the start of the guardrail window the report counts in


class Placements(Protocol):
    """The live rollouts at one fleet revision, as the roller asks about them."""

    def placements(
        self,
        model: str,
        device_id: str,
        attrs: Mapping,
        version: int,
        variant: str,
        at: dt.datetime,
    ) -> Iterable[Placement]:
        """Return where a device's report of `version`/`variant` of `model` made `at` counts."""
        ...


class Cohorts(Protocol):
    """What the roller needs of the rollouts: the current live ones, to place reports.

    Which cohort a report is in follows from assignment, which the rollouts own
    (control_plane.rollouts.resolver.Resolver is what the server passes); telemetry only
    adds the figures where it is told, so it depends on this shape, not on the rollouts.
    """

    def snapshot(self) -> Placements:
        """Return the live rollouts after the latest change."""
        ...


class Roller:
    """Rolls up stored batches; safe to run on every replica at once."""

    def __init__(
        self,
        store: RollupStore | FleetStore,
        resolver: Cohorts,
        device_class: DeviceClass,
        *,
        retention: Retention | None = None,
        clock: Callable[[], dt.datetime] = utcnow,
        batches_per_round: int = BATCHES_PER_ROUND,
        straggler_age: dt.timedelta = STRAGGLER_AGE,
    ) -> None:
        self._store, self._resolver, self._class = store, resolver, device_class
        self._retention, self._clock = retention or Retention(), clock
        self._limit, self._straggler_age = batches_per_round, straggler_age
        self._last_prune = float("-inf")
        self._fresh: collections.deque[ReportBatch] = collections.deque(maxlen=MAX_FRESH)
        self._fresh_lock = threading.Lock()
        self._observers: list[Callable[[Deltas], None]] = []

    def observe(self, observer: Callable[[Deltas], None]) -> None:
        """Call `observer` with the deltas of every round this roller applies (metrics)."""
        self._observers.append(observer)

    def offer(self, batches: list[ReportBatch]) -> None:
        """Hand over batches just stored by this replica (the writer calls this)."""
        with self._fresh_lock:
            self._fresh.extend(batches)

    def tick(self) -> int:
        """Roll up everything pending; prune now and then. Return batches rolled."""
        rolled = self.roll()
        if time.monotonic() - self._last_prune >= PRUNE_EVERY_S:
            self._last_prune = time.monotonic()
            gone = self.prune()
            if any(gone.values()):
                log.info("telemetry retention: deleted %s", gone)
        return rolled

    def roll(self, max_rounds: int = 50) -> int:
        """Roll up what this replica stored (from memory), then stragglers (database).

        Only the batches waiting when the call begins: those stored meanwhile wait for
        the next call. A round costs mostly its rollup rows (one per group and bucket,
        however many batches fill it), so chasing the stream in small rounds cost more
        per batch the busier the replica got (on PostgreSQL, 0.9 ms a batch instead of
        0.2 ms, and a third of Report's throughput). Stragglers get their turn every time,
        however busy the replica: batches missed in memory (a restart, a full queue, a
        lost race, a database error) are not starved by a steady flow of new ones.
        """
        total = 0
        with self._fresh_lock:
            waiting = len(self._fresh)
        for _ in range(max_rounds):
            with self._fresh_lock:
                take = min(self._limit, waiting, len(self._fresh))
                fresh = [self._fresh.popleft() for _ in range(take)]
            if not fresh:
                break
            waiting -= take
            total += self._round(self._from_memory(fresh))
        for _ in range(max_rounds):
            before = self._clock() - self._straggler_age
            pending = self._store.pending_batches(limit=self._limit, received_before=before)
            total += self._round(pending)
            if len(pending) < self._limit:
                break
        return total

    def _from_memory(self, fresh: list[ReportBatch]) -> list[PendingBatch]:
        attributes = self._store.device_attributes(sorted({b.device_id for b in fresh}))
        return [
            PendingBatch(
                b.device_id, b.batch_id, b.period_end, attributes[b.device_id], b.models, b.installs
            )
            for b in fresh
            if b.device_id in attributes  # else deleted or revoked meanwhile
        ]

    def _round(self, pending: list[PendingBatch]) -> int:
        """Roll up one round; return how many batches (0 if another roller took some)."""
        if not pending:
            return 0
        deltas, devices = self._aggregate(pending)
        keys = [(b.device_id, b.batch_id) for b in pending]
        if not self._store.apply_rollups(keys, deltas, devices):
            log.info("another roller took some of %d batches first", len(keys))
            return 0
        for observer in self._observers:
            try:
                observer(deltas)
            except Exception:  # noqa: BLE001 - a metrics bug must not stop the rollups
                log.exception("rollup observer failed")
        return len(keys)

    def prune(self) -> dict[str, int]:
        """Apply retention to raw batches and rollups."""
        now = self._clock()
        return self._store.prune_telemetry(
            raw_before=now - self._retention.raw,
            batches_before=now - max(self._retention.raw, MAX_REPORT_AGE + dt.timedelta(days=1)),
            installs_before=now - max(self._retention.raw, self._retention.hour),
            cutoffs={res: now - self._retention.of(res) for res in RESOLUTIONS},
            rollout_devices_before=now - self._retention.devices,
            fleet_devices_before=now - self._retention.devices,
        )

    def _aggregate(self, pending: list[PendingBatch]):
        now = self._clock()
        oldest = {res: now - self._retention.of(res) for res in RESOLUTIONS}
        snapshot = self._resolver.snapshot()
        deltas: Deltas = {}
        devices: dict[DeviceKey, DeviceDelta] = {}

        buckets: dict[dt.datetime, list[tuple[int, dt.datetime]]] = {}

        def add(at: dt.datetime, key: RollupKey, apply: Callable[[Aggregate], None]) -> None:
            starts = buckets.get(at)
            if starts is None:  # the buckets `at` falls in, but those already past retention
                starts = buckets[at] = [
                    (res, start)
                    for res in RESOLUTIONS
                    if (start := bucket_start(at, res)) + dt.timedelta(seconds=res) > oldest[res]
                ]
            for res, start in starts:
                agg = deltas.get((res, start, key))
                if agg is None:
                    agg = deltas[res, start, key] = Aggregate()
                apply(agg)

        def add_device(key: DeviceKey, device_class: str, at: dt.datetime, apply) -> None:
            delta = devices.get(key)
            if delta is None:
                delta = devices[key] = DeviceDelta(device_class, at)
            elif at >= delta.last_seen:
                delta.device_class, delta.last_seen = device_class, at
            delta.reports += 1
            apply(delta.aggregate)

        for batch in pending:
            attrs, device = batch.attributes, batch.device_id
            device_class = self._class.of(attrs)
            # A device's report counts when it was made, however far ahead its clock runs.
            at = min(batch.period_end, now)
            # Each entry's figures worked out once, then added to every aggregate it counts in.
            items = [
                (s, at, functools.partial(Aggregate.add_stats, s=StatsDelta.of(s)))
                for s in batch.models
            ]
            items += [
                (i, min(i.at, now), functools.partial(Aggregate.add_install, record=i))
                for i in batch.installs
            ]
            for item, when, apply in items:
                dims = (item.model, item.version, item.variant, item.config)
                add(when, RollupKey(*dims, device_class), apply)
                if isinstance(item, ModelStatsRecord):
                    add_device(
                        DeviceKey(FLEET, EPOCH, "", *dims, device), device_class, when, apply
                    )
                placed = snapshot.placements(
                    item.model, device, attrs, item.version, item.variant, when
                )
                for p in placed:
                    if p.cohort != OUTSIDE:
                        # Rows over time, per cohort and slice: the rollout's charts.
                        add(when, RollupKey(*dims, p.device_class, p.rollout, p.cohort), apply)
                    key = DeviceKey(p.rollout, p.window, p.cohort, *dims, device)
                    add_device(key, p.device_class, when, apply)
        return deltas, devices
