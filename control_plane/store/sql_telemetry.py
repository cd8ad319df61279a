"""SQL implementation of the telemetry store, mixed into `SqlStore` (one engine, one scope)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence

from sqlalchemy import bindparam, or_, select, text, tuple_
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from contract import errors
from control_plane.store import orm
from control_plane.store.report_records import (
    InstallRecord,
    PeriodCheck,
    ReportBatch,
    StatsRow,
    TelemetryStore,
)
from control_plane.store.sql_bulk import Bulk
from control_plane.store.sql_fleet import aware
from control_plane.store.sql_report_rows import (
    batch_values,
    install_record,
    install_values,
    stats_record,
    stats_values,
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

    def add_reports(
        self, batches: Sequence[ReportBatch], *, check: PeriodCheck | None = None
    ) -> list[bool | errors.SkiffError]:
        """Store many batches in one transaction (group commit); a result per batch.

        The result is True (stored), False (stored before: same device and batch id,
        also within `batches`) or the error of that batch alone (NotFound for a device
        that does not exist, the error `check` returned for it). If the group fails as a
        whole, each batch is retried on its own, so one bad batch costs the others nothing.
        """
        try:
            return self._add_reports(batches, check)
        except errors.SkiffError:
            if len(batches) == 1:
                raise
        results: list[bool | errors.SkiffError] = []
        for batch in batches:
            try:
                results.extend(self._add_reports([batch], check))
            except errors.SkiffError as exc:
                results.append(exc)
        return results

    def note_report_refusals(self, refusals: Sequence[tuple[str, str, dt.datetime]]) -> None:
        """Count refused batches on their devices: (device id, reason, when), in one go."""
        counted: dict[str, list] = {}
        for device_id, reason, at in refusals:
            entry = counted.setdefault(device_id, [0, reason, at])
            entry[0] += 1
            if at >= entry[2]:
                entry[1:] = [reason, at]
        if not counted:
            return
        d = orm.DeviceRow.__table__
        with self._scope() as session:
            session.execute(
                d.update()
                .where(d.c.id == bindparam("b_id"))
                .values(
                    reports_refused=d.c.reports_refused + bindparam("b_n"),
                    last_refusal=bindparam("b_reason"),
                    last_refusal_at=bindparam("b_at"),
                ),
                [
                    {"b_id": device, "b_n": n, "b_reason": reason[:256], "b_at": at}
                    for device, (n, reason, at) in sorted(counted.items())
                ],
            )

    def _add_reports(
        self, batches: Sequence[ReportBatch], check: PeriodCheck | None
    ) -> list[bool | errors.SkiffError]:
        try:
            with self._scope() as session:
                pg = session.get_bind().dialect.name == "postgresql"
                dialect = postgresql if pg else sqlite
                wanted = sorted({b.device_id for b in batches})
                if pg:  # one statement text whatever the group's size (psycopg caches it)
                    rows = session.execute(_KNOWN_PG, {"ids": wanted})
                else:
                    d = orm.DeviceRow
                    rows = session.execute(select(d.id, d.enrolled_at).where(d.id.in_(wanted)))
                known = {device: aware(enrolled) for device, enrolled in rows}
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
                claim = _claim_pg if pg else _claim
                claimed = claim(session, fresh)
                stored = [b for b in fresh if (b.device_id, b.batch_id) in claimed]
                refused: dict[tuple[str, str], errors.SkiffError] = {}
                if check is not None:
                    refused = _check_periods(session, pg, stored, known, check)
                    stored = [b for b in stored if (b.device_id, b.batch_id) not in refused]
                stats = [stats_values(b, s) for b in stored for s in b.models]
                if stats:
                    (_copy_stats if pg else _insert_stats)(session, stats)
                _note_offsets(session, stored)
                installs = [install_values(b, i) for b in stored for i in b.installs]
                if installs:
                    session.execute(_INSTALLS.insert(), installs)
                for b in stored:
                    for record in sorted(b.installs, key=lambda i: i.at):
                        _apply_install(session, dialect, b.device_id, record)
                return [
                    refused.get((b.device_id, b.batch_id))
                    or (r if r is not True else (b.device_id, b.batch_id) in claimed)
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
            return [install_record(row) for row in rows]

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
            return [
                StatsRow(aware(x.period_start), aware(x.period_end), stats_record(x)) for x in rows
            ]


# PostgreSQL: statements whose text does not grow with the group. Long statements built
# per group (IN lists, multi-row VALUES) were parsed afresh by psycopg each time and rows
# sent one by one by executemany: most of a Report's cost in the writer.
_KNOWN_PG = text("SELECT id, enrolled_at FROM devices WHERE id = ANY(CAST(:ids AS text[]))")
_ENDS_PG = text(
    "SELECT device_id, model, period_end FROM report_periods"
    " WHERE device_id = ANY(CAST(:ids AS text[])) FOR UPDATE"
)
_PERIODS = orm.ReportPeriodRow.__table__
_BATCHES = orm.TelemetryBatchRow.__table__
_CLAIM_PG = text(
    "INSERT INTO telemetry_batches"
    " (device_id, batch_id, received_at, period_start, period_end, dropped_batches, rolled)"
    " SELECT *, false FROM unnest(CAST(:device_id AS text[]), CAST(:batch_id AS text[]),"
    " CAST(:received_at AS timestamptz[]), CAST(:period_start AS timestamptz[]),"
    " CAST(:period_end AS timestamptz[]), CAST(:dropped_batches AS integer[]))"
    " ON CONFLICT (device_id, batch_id) DO NOTHING RETURNING device_id, batch_id"
)
_STATS = orm.ModelStatsRow.__table__
_STATS_COLUMNS = [c.name for c in _STATS.columns if c.name != "id"]
_JSON_COLUMNS = {"latency", "events"}
_INSERT_STATS = Bulk.insert(_STATS, _STATS_COLUMNS)


def _claim(session: Session, batches: Sequence[ReportBatch]) -> set[tuple[str, str]]:
    """Insert the batches' rows unless already there; return the keys this call inserted."""
    table = orm.TelemetryBatchRow.__table__
    return {
        (row.device_id, row.batch_id)
        for row in session.execute(
            sqlite.insert(table)
            .on_conflict_do_nothing(index_elements=["device_id", "batch_id"])
            .returning(table.c.device_id, table.c.batch_id),
            [batch_values(b) for b in batches],
        )
    }


def _claim_pg(session: Session, batches: Sequence[ReportBatch]) -> set[tuple[str, str]]:
    """`_claim` on PostgreSQL, in one statement of fixed text (columns as arrays)."""
    rows = [batch_values(b) for b in batches]
    columns = ("device_id", "batch_id", "received_at", "period_start", "period_end")
    params = {c: [r[c] for r in rows] for c in (*columns, "dropped_batches")}
    return {(row.device_id, row.batch_id) for row in session.execute(_CLAIM_PG, params)}


def _note_offsets(session: Session, stored: Sequence[ReportBatch]) -> None:
    """Keep each device's latest clock offset (`fleet show`)."""
    offsets = {b.device_id: b.clock_offset_s for b in stored if b.clock_offset_s is not None}
    if offsets:
        d = orm.DeviceRow.__table__
        session.execute(
            d.update().where(d.c.id == bindparam("b_id")).values(clock_offset_s=bindparam("b_v")),
            [{"b_id": k, "b_v": v} for k, v in sorted(offsets.items())],
        )


def _check_periods(
    session: Session,
    pg: bool,
    stored: list[ReportBatch],
    enrolled: dict[str, dt.datetime],
    check: PeriodCheck,
) -> dict[tuple[str, str], errors.SkiffError]:
    """Apply `check` to each stored batch, in order; un-claim and return the refused.

    The devices' period ends are read locked (PostgreSQL: FOR UPDATE), moved, and written
    back in the same transaction, so two replicas cannot both accept one period.
    """
    with_stats = [b for b in stored if b.models]
    if not with_stats:
        return {}
    ids = sorted({b.device_id for b in with_stats})
    if pg:
        rows = session.execute(_ENDS_PG, {"ids": ids})
    else:
        p = _PERIODS.c
        rows = session.execute(
            select(p.device_id, p.model, p.period_end).where(p.device_id.in_(ids))
        )
    before = {(device, model): aware(end) for device, model, end in rows}
    ends: dict[str, dict[str, dt.datetime]] = {}
    for (device, model), end in before.items():
        ends.setdefault(device, {})[model] = end
    refused: dict[tuple[str, str], errors.SkiffError] = {}
    for b in with_stats:
        error = check(b, enrolled[b.device_id], ends.setdefault(b.device_id, {}))
        if error is not None:
            refused[b.device_id, b.batch_id] = error
    if refused:
        session.execute(
            _BATCHES.delete().where(
                tuple_(_BATCHES.c.device_id, _BATCHES.c.batch_id).in_(list(refused))
            )
        )
    moved = [
        {"device_id": device, "model": model, "period_end": end}
        for device, models in ends.items()
        for model, end in models.items()
        if before.get((device, model)) != end
    ]
    new = [m for m in moved if (m["device_id"], m["model"]) not in before]
    if new:
        session.execute(_PERIODS.insert(), new)
    old = [{"b_" + k: v for k, v in m.items()} for m in moved if m not in new]
    if old:
        session.execute(
            _PERIODS.update()
            .where(
                _PERIODS.c.device_id == bindparam("b_device_id"),
                _PERIODS.c.model == bindparam("b_model"),
            )
            .values(period_end=bindparam("b_period_end")),
            old,
        )
    return refused


def _insert_stats(session: Session, rows: list[dict]) -> None:
    _INSERT_STATS.run(session, [tuple(row[c] for c in _STATS_COLUMNS) for row in rows])


def _copy_stats(session: Session, rows: list[dict]) -> None:
    """Insert stats rows with COPY (PostgreSQL): one stream, rows formatted by psycopg's C."""
    import psycopg  # only ever with a PostgreSQL store

    sql = f"COPY {_STATS.name} ({', '.join(_STATS_COLUMNS)}) FROM STDIN"
    try:
        cursor = session.connection().connection.driver_connection.cursor()
        with cursor, cursor.copy(sql) as copy:
            for row in rows:
                copy.write_row(
                    [json.dumps(row[c]) if c in _JSON_COLUMNS else row[c] for c in _STATS_COLUMNS]
                )
    except psycopg.Error as exc:  # raw driver errors: wrapped as SQLAlchemy's, then sorted
        raise sa_exc.DBAPIError.instance(sql, None, exc, psycopg.Error) from exc


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
