"""The rollup store interface, and the keys and rows it keeps.

A rollup row is one group of devices (model, version, variant, backend config, device
class; optionally one cohort of one rollout) over one time bucket, holding an `Aggregate`
(control_plane.store.rollup_aggregate): every field adds up exactly across rows, so any
window or grouping is a merge of rows. A device row is one device's share of a rollout's
window (or of the fleet), read many at once as a `DeviceTable`
(control_plane.store.device_table).
"""

from __future__ import annotations

import abc
import datetime as dt
import hashlib
import json
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from control_plane.store.report_records import InstallRecord, ModelStatsRecord
from control_plane.store.rollup_aggregate import COUNTERS, Aggregate

if TYPE_CHECKING:  # it reads rows of this module's kinds
    from control_plane.store.device_table import DeviceTable


@dataclass(frozen=True)
class RollupKey:
    """The group one rollup row holds; `rollout`/`cohort` empty for fleet-wide groups."""

    model: str
    version: int
    variant: str
    config: str
    device_class: str
    rollout: str = ""
    cohort: str = ""

    @property
    def digest(self) -> str:
        """Return the key's identity within a bucket (SHA-256 hex of every field)."""
        text = json.dumps(
            [
                self.model,
                self.version,
                self.variant,
                self.config,
                self.device_class,
                self.rollout,
                self.cohort,
            ],
            ensure_ascii=False,
        )
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class PendingBatch:
    """A stored telemetry batch the roller has not merged yet, with its device's attributes."""

    device_id: str
    batch_id: str
    period_end: dt.datetime
    attributes: dict
    models: tuple[ModelStatsRecord, ...]
    installs: tuple[InstallRecord, ...]


# Scope of the fleet-wide device rows (backend recommendations), and their one window.
FLEET = ""
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# The cohorts a rollout's rows are kept under: which one a report is in is the rollouts'
# call (control_plane.rollouts.resolver.Snapshot.placements); its name is stored here.
CANDIDATE, BASELINE, OUTSIDE = "candidate", "baseline", "outside"


@dataclass(frozen=True)
class DeviceKey:
    """One device's row: in a rollout's cohort and window, or fleet-wide (scope FLEET).

    A rollout's rows are per window (`window` is the start of the stage, or of a slice's
    readmission, the report fell in), so a cohort's figures over its current window are
    a sum of whole rows, per device: guardrails need each device's own figures to keep any
    one device from deciding a verdict (control_plane.telemetry.robust).
    """

    scope: str
    window: dt.datetime
    cohort: str
    model: str
    version: int
    variant: str
    config: str
    device_id: str

    @property
    def digest(self) -> str:
        """Return the row's identity (SHA-256 hex of every field)."""
        text = json.dumps(
            [
                self.scope,
                int(self.window.timestamp()),
                self.cohort,
                self.model,
                self.version,
                self.variant,
                self.config,
                self.device_id,
            ],
            ensure_ascii=False,
        )
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class DeviceDelta:
    """What a roller round adds to one device row."""

    device_class: str
    last_seen: dt.datetime
    reports: int = 0
    aggregate: Aggregate = field(default_factory=Aggregate)

    def add(self, other: DeviceDelta) -> None:
        """Merge another delta of the same row (the later class wins)."""
        if other.last_seen >= self.last_seen:
            self.device_class, self.last_seen = other.device_class, other.last_seen
        self.reports += other.reports
        self.aggregate.merge(other.aggregate)


@dataclass(frozen=True)
class DeviceRollup:
    """A stored device row: its key, latest class and time, reports and aggregate.

    The histogram is kept sparse (`index`, `counts`): a rollout may hold a row for every
    device of a large fleet, and a dense histogram is 218 counts.
    """

    key: DeviceKey
    device_class: str
    last_seen: dt.datetime
    reports: int
    counters: dict[str, int]
    crash_signals: dict[str, int]
    latency_count: int
    latency_sum_ns: int
    latency_min_ns: int | None
    latency_max_ns: int | None
    index: np.ndarray
    counts: np.ndarray
    # A language model's time to first token (Aggregate.ttft); None when none was timed.
    ttft: Aggregate | None = None

    @classmethod
    def of(
        cls,
        key: DeviceKey,
        aggregate: Aggregate,
        *,
        device_class: str = "{}",
        last_seen: dt.datetime = EPOCH,
        reports: int = 1,
    ) -> DeviceRollup:
        """Return a row holding `aggregate` (what the store reads back after a merge)."""
        index = np.flatnonzero(aggregate.buckets)
        return cls(
            key=key,
            device_class=device_class,
            last_seen=last_seen,
            reports=reports,
            counters={name: getattr(aggregate, name) for name in COUNTERS},
            crash_signals=dict(aggregate.crash_signals),
            latency_count=aggregate.latency_count,
            latency_sum_ns=aggregate.latency_sum_ns,
            latency_min_ns=aggregate.latency_min_ns,
            latency_max_ns=aggregate.latency_max_ns,
            index=index.astype("<u2"),
            counts=aggregate.buckets[index].astype("<i8"),
            ttft=aggregate.ttft,
        )

    def histogram(self) -> Aggregate | None:
        """Return the row's latency histogram alone, as an aggregate (None when empty)."""
        return self.aggregate().histogram_only()

    def aggregate(self) -> Aggregate:
        """Return the row as a (dense) aggregate."""
        agg = Aggregate(**self.counters)
        agg.crash_signals.update(self.crash_signals)
        if self.latency_count:
            agg._add_latency(
                self.latency_count, self.latency_sum_ns, self.latency_min_ns, self.latency_max_ns
            )
            agg.buckets[self.index.astype(np.intp)] = self.counts
        if self.ttft is not None and self.ttft.latency_count:
            agg.ttft = Aggregate()
            agg.ttft.merge(self.ttft)
        return agg


class RollupStore(abc.ABC):
    """Where rolled-up telemetry is kept."""

    @abc.abstractmethod
    def pending_batches(
        self, *, limit: int, received_before: dt.datetime | None = None
    ) -> list[PendingBatch]:
        """Return up to `limit` batches not yet rolled up, oldest first."""

    @abc.abstractmethod
    def apply_rollups(
        self,
        batches: list[tuple[str, str]],
        deltas: dict[tuple[int, dt.datetime, RollupKey], Aggregate],
        device_deltas: dict[DeviceKey, DeviceDelta],
    ) -> bool:
        """Merge `deltas` and `device_deltas`, and mark `batches` rolled, in one transaction.

        False (and nothing written) when another roller rolled any of them first.
        """

    @abc.abstractmethod
    def prune_telemetry(
        self,
        *,
        raw_before: dt.datetime,
        batches_before: dt.datetime,
        installs_before: dt.datetime,
        cutoffs: dict[int, dt.datetime],
        rollout_devices_before: dt.datetime,
        fleet_devices_before: dt.datetime,
    ) -> dict[str, int]:
        """Delete old telemetry; return how many rows of each kind went.

        Rolled model stats before `raw_before`, batch ids (kept for de-duplication)
        before `batches_before`, install reports before `installs_before`, rollups past
        their resolution's cutoff, device rows last seen before their scope's cutoff.
        """

    @abc.abstractmethod
    def merged_rollups(
        self,
        *,
        resolution_s: int,
        since: dt.datetime,
        until: dt.datetime | None = None,
        rollout: str | None = None,
        model: str | None = None,
        version: int | None = None,
        group: Callable[[dt.datetime, RollupKey], Hashable] = lambda _at, key: key,
    ) -> dict[Hashable, Aggregate]:
        """Merge rollup rows of one resolution with bucket_start in [since, until).

        Rows are merged per `group(bucket_start, key)` (None: skip the row); with
        `rollout` None, fleet-wide rows only.
        """

    @abc.abstractmethod
    def device_table(
        self,
        scope: str,
        *,
        model: str | None = None,
        version: int | None = None,
        seen_since: dt.datetime | None = None,
        windows_since: dt.datetime | None = None,
        windows_before: dt.datetime | None = None,
        cohorts: tuple[str, ...] | None = None,
        lean: bool = False,
    ) -> DeviceTable:
        """Return the device rows of one scope (a rollout id, or FLEET) as a table.

        Optionally only one model version's, only rows seen since `seen_since`, only
        windows starting in [windows_since, windows_before), only the `cohorts` named (an
        empty tuple: no rows); `lean`: without the `LEAN_SKIPS` columns (None in the
        table), which a health view never reads.
        """

    @abc.abstractmethod
    def cohort_totals(self, scope: str, cohort: str) -> tuple[int, int]:
        """Return (reports, distinct devices) of one cohort's rows over every window."""

    def device_rollups(self, scope: str, **filters) -> list[DeviceRollup]:
        """Return `device_table`'s rows one by one (for a few: tests, small reads)."""
        return self.device_table(scope, **filters).rows()
