"""The telemetry store interface: the raw batches devices report, kept for rollups."""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

INSTALL_RESULTS = ("activated", "failed", "rolled_back")
# The oldest report accepted (a device keeps 7 days of queue; with a margin). Batch ids are
# remembered at least this long, so a batch sent again is never counted twice.
MAX_REPORT_AGE = dt.timedelta(days=30)


@dataclass(frozen=True)
class ModelStatsRecord:
    """One model version's serving stats on one backend config over a batch's period."""

    model: str
    version: int
    variant: str
    config: str
    inferences: int
    errors: int
    pipeline_firings: int
    latency: dict  # runtime.LatencyHistogram.to_dict() (its buckets may be tuples)
    crashes: tuple[dict, ...] = ()
    fallbacks: tuple[dict, ...] = ()
    # Language models only (device.proto ModelStats): `latency` is then decode time per
    # token; these are time to first token (a histogram, {} when none), tokens prefilled
    # and generated, and generations their caller cancelled.
    ttft: dict = field(default_factory=dict)
    tokens_in: int = 0
    tokens_out: int = 0
    cancellations: int = 0


@dataclass(frozen=True)
class InstallRecord:
    """One install outcome: activated, failed (never activated) or rolled back."""

    at: dt.datetime
    model: str
    version: int
    variant: str
    rollout: str
    result: str  # one of INSTALL_RESULTS
    reason: str = ""
    config: str = ""
    timings: dict = field(default_factory=dict)
    probes: tuple[dict, ...] = ()


@dataclass(frozen=True)
class ReportBatch:
    """A validated telemetry batch from one device."""

    device_id: str
    batch_id: str
    received_at: dt.datetime
    period_start: dt.datetime
    period_end: dt.datetime
    dropped_batches: int
    models: tuple[ModelStatsRecord, ...]
    installs: tuple[InstallRecord, ...]
    # The device's clock minus the control plane's, as the device measured it.
    clock_offset_s: float | None = None


# (batch, when its device enrolled, where its last periods ended per model) -> refusal.
PeriodCheck = Callable[[ReportBatch, dt.datetime, dict[str, dt.datetime]], Exception | None]


@dataclass(frozen=True)
class StatsRow:
    """A stored ModelStatsRecord with the period it covers."""

    period_start: dt.datetime
    period_end: dt.datetime
    stats: ModelStatsRecord


class TelemetryStore(abc.ABC):
    """Where device telemetry is kept."""

    @abc.abstractmethod
    def add_report(self, batch: ReportBatch) -> bool:
        """Store a batch and apply its install outcomes; False if it was stored before.

        In one transaction: a batch id is applied once per device, whoever sends it twice.
        """

    @abc.abstractmethod
    def add_reports(
        self, batches: Sequence[ReportBatch], *, check: PeriodCheck | None = None
    ) -> list[bool | Exception]:
        """Store many batches in one transaction; per batch True, False or its error.

        `check(batch, enrolled_at, ends)` is called, inside the transaction, for each new
        batch reporting stats: `ends` holds where the device's last accepted period of each
        model ended (the check moves it on acceptance); an error it returns refuses the
        batch (control_plane.telemetry.budget).
        """

    @abc.abstractmethod
    def note_report_refusals(self, refusals: Sequence[tuple[str, str, dt.datetime]]) -> None:
        """Count refused batches on their devices: (device id, reason, when)."""

    @abc.abstractmethod
    def recent_installs(self, device_id: str, *, limit: int) -> list[InstallRecord]:
        """Return a device's latest install outcomes, newest first."""

    @abc.abstractmethod
    def device_stats(
        self, device_id: str, *, since: dt.datetime, limit: int = 5000
    ) -> list[StatsRow]:
        """Return a device's latest model stats (at most `limit`) ending after `since`."""
