"""Device telemetry: store validated batches; summarise one device's recent reports.

Batches are stored raw (per device, per batch, per model version and backend config),
so fleet-wide rollups can merge them in any grouping later: latency histograms add
bucket by bucket (runtime.LatencyHistogram).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.store.report_records import InstallRecord, ReportBatch, TelemetryStore
from control_plane.telemetry.catalog import Catalog
from control_plane.telemetry.ingest import ReportWriter
from runtime.histogram import LatencyHistogram

# `fleet show` merges a device's reports over this window.
SUMMARY_WINDOW = dt.timedelta(hours=24)
RECENT_INSTALLS = 10


@dataclass(frozen=True)
class DeviceLatency:
    """One model version on one backend config of a device, over its recent reports."""

    model: str
    version: int
    variant: str
    config: str
    inferences: int
    errors: int
    crashes: int
    histogram: LatencyHistogram
    since: dt.datetime
    pipeline_firings: int = 0


class Telemetry:
    """What devices report, and one device's summary of it."""

    def __init__(
        self,
        store: TelemetryStore,
        *,
        on_stored: Callable[[list[ReportBatch]], None] | None = None,
        catalog: Catalog | None = None,
    ) -> None:
        self._store = store
        self.writer = ReportWriter(store, on_stored=on_stored, catalog=catalog)

    def report(self, batch: ReportBatch) -> concurrent.futures.Future:
        """Queue a batch for the next group commit.

        The future resolves to True once stored, False when this device sent the same
        batch id before.
        """
        return self.writer.submit(batch)

    def report_async(self, batch: ReportBatch) -> asyncio.Future:
        """`report` for a coroutine on the running loop (cheaper than wrapping `report`)."""
        return self.writer.submit_async(batch)

    def refused(self, device_id: str, reason: str) -> None:
        """Count a batch refused before it was stored (`fleet show` shows the count)."""
        self.writer.refused(device_id, reason, dt.datetime.now(dt.UTC))

    def close(self) -> None:
        """Store what is queued and stop the writer."""
        self.writer.close()

    def recent_installs(self, device_id: str) -> list[InstallRecord]:
        """Return the device's latest install outcomes, newest first."""
        return self._store.recent_installs(device_id, limit=RECENT_INSTALLS)

    def latency(self, device_id: str, *, now: dt.datetime | None = None) -> list[DeviceLatency]:
        """Merge the device's stats of the last 24 hours per model version and config."""
        since = (now or dt.datetime.now(dt.UTC)) - SUMMARY_WINDOW
        merged: dict[tuple, list] = {}
        for row in self._store.device_stats(device_id, since=since):
            s = row.stats
            key = (s.model, s.version, s.variant, s.config)
            acc = merged.setdefault(key, [0, 0, 0, LatencyHistogram(), row.period_start, 0])
            acc[0] += s.inferences
            acc[1] += s.errors
            acc[2] += len(s.crashes)
            acc[3].update(LatencyHistogram.from_dict(s.latency))
            acc[4] = min(acc[4], row.period_start)
            acc[5] += s.pipeline_firings
        return [DeviceLatency(*key, *acc) for key, acc in sorted(merged.items())]
