"""SQL implementation of the telemetry store, mixed into `SqlStore` (one engine, one scope)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import or_, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from control_plane import errors
from control_plane.store import orm
from control_plane.store.sql_fleet import aware
from control_plane.store.telemetry import (
    InstallRecord,
    ModelStatsRecord,
    ReportBatch,
    StatsRow,
    TelemetryStore,
)


class SqlTelemetryStore(TelemetryStore):
    """The telemetry half of `SqlStore`; needs `_scope()` and `_read()` from it."""

    def add_report(self, batch: ReportBatch) -> bool:
        """Store a batch and apply its install outcomes; False if it was stored before."""
        try:
            with self._scope() as session:
                if session.get(orm.DeviceRow, batch.device_id) is None:
                    raise errors.NotFound(f"device {batch.device_id} not found")
                dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
                # Claim the batch id first: a concurrent copy of the same batch waits on
                # this row and then finds it taken (nothing else of it is written).
                claimed = session.execute(
                    dialect.insert(orm.TelemetryBatchRow.__table__)
                    .values(
                        device_id=batch.device_id,
                        batch_id=batch.batch_id,
                        received_at=batch.received_at,
                        period_start=batch.period_start,
                        period_end=batch.period_end,
                        dropped_batches=batch.dropped_batches,
                    )
                    .on_conflict_do_nothing(index_elements=["device_id", "batch_id"])
                    .returning(orm.TelemetryBatchRow.__table__.c.batch_id)
                ).first()
                if claimed is None:
                    return False
                session.add_all(_stats_row(batch, s) for s in batch.models)
                session.add_all(_install_row(batch, i) for i in batch.installs)
                for record in sorted(batch.installs, key=lambda i: i.at):
                    _apply_install(session, dialect, batch.device_id, record)
                return True
        except errors.AlreadyExists:  # the device row vanished mid-way (cascade)
            raise errors.NotFound(f"device {batch.device_id} not found") from None

    def recent_installs(self, device_id: str, *, limit: int) -> list[InstallRecord]:
        """Return a device's latest install outcomes, newest first."""
        r = orm.InstallReportRow
        with self._read() as session:
            rows = session.scalars(
                select(r)
                .where(r.device_id == device_id)
                .order_by(r.at.desc(), r.id.desc())
                .limit(limit)
            ).all()
            return [_install(row) for row in rows]

    def device_stats(
        self, device_id: str, *, since: dt.datetime, limit: int = 5000
    ) -> list[StatsRow]:
        """Return a device's latest model stats (at most `limit`) ending after `since`.

        Oldest first.
        """
        r = orm.ModelStatsRow
        with self._read() as session:
            rows = session.scalars(
                select(r)
                .where(r.device_id == device_id, r.period_end > since)
                .order_by(r.period_end.desc(), r.id.desc())
                .limit(limit)
            ).all()
            rows.reverse()
            return [StatsRow(aware(x.period_start), aware(x.period_end), _stats(x)) for x in rows]


def _stats_row(batch: ReportBatch, s: ModelStatsRecord) -> orm.ModelStatsRow:
    return orm.ModelStatsRow(
        device_id=batch.device_id,
        batch_id=batch.batch_id,
        period_start=batch.period_start,
        period_end=batch.period_end,
        model=s.model,
        version=s.version,
        variant=s.variant,
        config=s.config,
        inferences=s.inferences,
        errors=s.errors,
        crashes=len(s.crashes),
        fallbacks=len(s.fallbacks),
        pipeline_firings=s.pipeline_firings,
        latency=s.latency,
        events={"crashes": list(s.crashes), "fallbacks": list(s.fallbacks)},
    )


def _stats(row: orm.ModelStatsRow) -> ModelStatsRecord:
    events = row.events or {}
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
    )


def _install_row(batch: ReportBatch, i: InstallRecord) -> orm.InstallReportRow:
    return orm.InstallReportRow(
        device_id=batch.device_id,
        batch_id=batch.batch_id,
        at=i.at,
        model=i.model,
        version=i.version,
        variant=i.variant,
        rollout=i.rollout,
        result=i.result,
        reason=i.reason,
        config=i.config,
        timings=i.timings,
        probes=list(i.probes),
    )


def _install(row: orm.InstallReportRow) -> InstallRecord:
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


def _apply_install(session: Session, dialect, device_id: str, i: InstallRecord) -> None:
    """Move the device's installed or failed version for the model, as the report says."""
    table = orm.DeviceModelRow.__table__
    key = {"device_id": device_id, "model": i.model}
    if i.result == "activated":
        values = {
            "installed_version": i.version,
            "installed_variant": i.variant,
            "reported_at": i.at,
        }
    else:
        values = {
            "failed_version": i.version,
            "failed_variant": i.variant,
            "failed_reason": i.reason,
            "failed_at": i.at,
        }
    # Reports may arrive out of order (a queue drained after a newer Sync): an outcome
    # older than what is recorded changes nothing.
    stamp = table.c.reported_at if i.result == "activated" else table.c.failed_at
    insert = dialect.insert(table).values({**key, **values})
    session.execute(
        insert.on_conflict_do_update(
            index_elements=list(key),
            set_=values,
            where=or_(stamp.is_(None), stamp <= i.at),
        )
    )
    if i.result == "activated":  # it made it after all: no longer failed
        session.execute(
            table.update()
            .where(
                table.c.device_id == device_id,
                table.c.model == i.model,
                table.c.failed_version == i.version,
                table.c.failed_variant == i.variant,
            )
            .values(failed_version=None, failed_variant=None, failed_reason="", failed_at=None)
        )
