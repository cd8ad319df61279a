"""Report records <-> their ORM rows, written once for every SQL module that needs them.

The telemetry store writes a device's batches (`sql_telemetry`) and the roller's store
reads them back to roll up (`sql_rollups`): both map the same rows, so the mapping lives
here, public, rather than as one module's private helpers the other reaches into.
"""

from __future__ import annotations

from control_plane.store import orm
from control_plane.store.report_records import InstallRecord, ModelStatsRecord, ReportBatch
from control_plane.store.sql_fleet import aware


def batch_values(batch: ReportBatch) -> dict:
    """Return the telemetry_batches row of a batch, not rolled up yet."""
    return {
        "device_id": batch.device_id,
        "batch_id": batch.batch_id,
        "received_at": batch.received_at,
        "period_start": batch.period_start,
        "period_end": batch.period_end,
        "dropped_batches": batch.dropped_batches,
        "rolled": False,
    }


def stats_values(batch: ReportBatch, s: ModelStatsRecord) -> dict:
    """Return the telemetry_model_stats row of one model's stats in a batch."""
    return {
        "device_id": batch.device_id,
        "batch_id": batch.batch_id,
        "period_start": batch.period_start,
        "period_end": batch.period_end,
        "model": s.model,
        "version": s.version,
        "variant": s.variant,
        "config": s.config,
        "inferences": s.inferences,
        "errors": s.errors,
        "crashes": len(s.crashes),
        "fallbacks": len(s.fallbacks),
        "pipeline_firings": s.pipeline_firings,
        "latency": s.latency,
        "events": _events(s),
    }


def _events(s: ModelStatsRecord) -> dict:
    # A language model's figures ride in the events document: no column for what most
    # models never report.
    events: dict = {"crashes": list(s.crashes), "fallbacks": list(s.fallbacks)}
    if s.ttft or s.tokens_in or s.tokens_out or s.cancellations:
        events["llm"] = {
            "ttft": s.ttft,
            "tokens_in": s.tokens_in,
            "tokens_out": s.tokens_out,
            "cancellations": s.cancellations,
        }
    return events


def stats_record(row: orm.ModelStatsRow) -> ModelStatsRecord:
    """Return the record a telemetry_model_stats row holds."""
    events = row.events or {}
    llm = events.get("llm") or {}
    return ModelStatsRecord(
        model=row.model,
        version=row.version,
        variant=row.variant,
        config=row.config,
        inferences=row.inferences,
        errors=row.errors,
        pipeline_firings=row.pipeline_firings,
        latency=dict(row.latency),
        crashes=tuple(events.get("crashes", ())),
        fallbacks=tuple(events.get("fallbacks", ())),
        ttft=dict(llm.get("ttft") or {}),
        tokens_in=int(llm.get("tokens_in", 0)),
        tokens_out=int(llm.get("tokens_out", 0)),
        cancellations=int(llm.get("cancellations", 0)),
    )


def install_values(batch: ReportBatch, i: InstallRecord) -> dict:
    """Return the install_reports row of one install outcome in a batch."""
    return {
        "device_id": batch.device_id,
        "batch_id": batch.batch_id,
        "at": i.at,
        "model": i.model,
        "version": i.version,
        "variant": i.variant,
        "rollout": i.rollout,
        "result": i.result,
        "reason": i.reason,
        "config": i.config,
        "timings": i.timings,
        "probes": list(i.probes),
    }


def install_record(row: orm.InstallReportRow) -> InstallRecord:
    """Return the record an install_reports row holds."""
    return InstallRecord(
        at=aware(row.at),
        model=row.model,
        version=row.version,
        variant=row.variant,
        rollout=row.rollout,
        result=row.result,
        reason=row.reason,
        config=row.config,
        timings=dict(row.timings),
        probes=tuple(row.probes),
    )
