"""SQL implementation of the telemetry store, mixed into `SqlStore` (one engine, one scope)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence

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

_INSTALLS = orm.InstallReportRow.__table__


class SqlTelemetryStore(TelemetryStore):
    """The telemetry half of `SqlStore`; needs `_scope()` and `_read()` from it."""

    def add_report(self, batch: ReportBatch) -> bool:
        """Store a batch and apply its install outcomes; False if it was stored before."""
        (result,) = self.add_reports([batch])
        if isinstance(result, Exception):
            raise result
        return result

    def add_reports(self, batches: Sequence[ReportBatch]) -> list[bool | errors.SkiffError]:
        """Store many batches in one transaction (group commit); a result per batch.

        The result is True (stored), False (stored before: same device and batch id,
        also within `batches`) or the error of that batch alone (NotFound for a device
        that does not exist). If the group fails as a whole, each batch is retried on its
        own, so one bad batch costs the others nothing.
        """
        try:
            return self._add_reports(batches)
        except errors.SkiffError:
            if len(batches) == 1:
                raise
        results: list[bool | errors.SkiffError] = []
        for batch in batches:
            try:
                results.extend(self._add_reports([batch]))
            except errors.SkiffError as exc:
                results.append(exc)
        return results

    def _add_reports(self, batches: Sequence[ReportBatch]) -> list[bool | errors.SkiffError]:
        try:
            with self._scope() as session:
                dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
                wanted = sorted({b.device_id for b in batches})
                known = set(
                    session.scalars(select(orm.DeviceRow.id).where(orm.DeviceRow.id.in_(wanted)))
                )
                results: list[bool | errors.SkiffError] = []
                fresh: list[ReportBatch] = []
                seen: set[tuple[str, str]] = set()
                for b in batches:
                    if b.device_id not in known:
                        results.append(errors.NotFound(f"device {b.device_id} not found"))
                    elif (b.device_id, b.batch_id) in seen:
                        results.append(False)
                    else:
                        seen.add((b.device_id, b.batch_id))
                        fresh.append(b)
                        results.append(True)
                if not fresh:
                    return results
                # Claim the batch ids first: a concurrent copy of the same batch waits on
                # its row and then finds it taken (nothing else of it is written).
                table = orm.TelemetryBatchRow.__table__
                claimed = {
                    (row.device_id, row.batch_id)
                    for row in session.execute(
                        dialect.insert(table)
                        .on_conflict_do_nothing(index_elements=["device_id", "batch_id"])
                        .returning(table.c.device_id, table.c.batch_id),
                        [_batch_values(b) for b in fresh],
                    )
                }
                stored = [b for b in fresh if (b.device_id, b.batch_id) in claimed]
                stats = [_stats_values(b, s) for b in stored for s in b.models]
                for rows, table in (
                    (stats, orm.ModelStatsRow.__table__),
                    ([_install_values(b, i) for b in stored for i in b.installs], _INSTALLS),
                ):
                    if rows:
                        session.execute(table.insert(), rows)
                for b in stored:
                    for record in sorted(b.installs, key=lambda i: i.at):
                        _apply_install(session, dialect, b.device_id, record)
                return [
                    r if r is not True else (b.device_id, b.batch_id) in claimed
                    for b, r in zip(batches, results, strict=True)
                ]
        except errors.AlreadyExists:  # a device row vanished mid-way (cascade)
            raise errors.NotFound("a reporting device was deleted meanwhile") from None

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


def _batch_values(batch: ReportBatch) -> dict:
    return {
        "device_id": batch.device_id,
        "batch_id": batch.batch_id,
        "received_at": batch.received_at,
        "period_start": batch.period_start,
        "period_end": batch.period_end,
        "dropped_batches": batch.dropped_batches,
        "rolled": False,
    }


def _stats_values(batch: ReportBatch, s: ModelStatsRecord) -> dict:
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
        "events": {"crashes": list(s.crashes), "fallbacks": list(s.fallbacks)},
    }


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


def _install_values(batch: ReportBatch, i: InstallRecord) -> dict:
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
