"""SQL implementation of the rollup store, mixed into `SqlStore` (one engine, one scope)."""

from __future__ import annotations

import collections
import datetime as dt
from collections.abc import Callable, Hashable

import numpy as np
from sqlalchemy import bindparam, case, delete, func, select, text, true, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite

from control_plane.store import orm
from control_plane.store.rollups import (
    COUNTERS,
    INCIDENTS,
    Aggregate,
    CohortDevice,
    PendingBatch,
    RollupKey,
    RollupStore,
    clamp,
    decode_buckets,
    encode_buckets,
)
from control_plane.store.sql_fleet import aware
from control_plane.store.sql_telemetry import _install, _stats
from runtime.histogram import N_BUCKETS

_CHUNK = 500  # keys per IN (...) list
# Rollers on several replicas take turns on this transaction-scoped advisory lock.
_ROLLER_LOCK = 0x534B4946  # "SKIF"
_R = orm.RollupRow.__table__
_MERGED = (
    *COUNTERS,
    "crash_signals",
    "latency_count",
    "latency_sum_ns",
    "latency_min_ns",
    "latency_max_ns",
    "latency_buckets",
)
_UPDATE = (
    _R.update()
    .where(
        _R.c.resolution_s == bindparam("b_resolution_s"),
        _R.c.bucket_start == bindparam("b_bucket_start"),
        _R.c.key == bindparam("b_key"),
    )
    .values({name: bindparam("b_" + name) for name in _MERGED})
)
# PostgreSQL: the batches a round claims, as two arrays (one statement, whatever the count).
_CLAIM_PG = text(
    "UPDATE telemetry_batches SET rolled = true WHERE rolled = false AND (device_id, batch_id)"
    " IN (SELECT * FROM unnest(CAST(:devices AS text[]), CAST(:batches AS text[])))"
)


def _chunks(items: list, size: int = _CHUNK):
    for i in range(0, len(items), size):
        yield items[i : i + size]


class SqlRollupStore(RollupStore):
    """The rollup half of `SqlStore`; needs `_scope()` and `_read()` from it."""

    def pending_batches(
        self, *, limit: int, received_before: dt.datetime | None = None
    ) -> list[PendingBatch]:
        """Return up to `limit` batches not yet rolled up, oldest first."""
        b, s, i, d = (
            orm.TelemetryBatchRow,
            orm.ModelStatsRow,
            orm.InstallReportRow,
            orm.DeviceRow,
        )
        with self._read() as session:
            rows = session.execute(
                select(b.device_id, b.batch_id, b.period_end, d.attributes)
                .join(d, d.id == b.device_id)
                .where(
                    b.rolled.is_(False),
                    b.received_at < received_before if received_before is not None else true(),
                )
                .order_by(b.received_at, b.device_id, b.batch_id)
                .limit(limit)
            ).all()
            keys = [(r.device_id, r.batch_id) for r in rows]
            stats: dict = collections.defaultdict(list)
            installs: dict = collections.defaultdict(list)
            for chunk in _chunks(keys):
                in_chunk = tuple_(s.device_id, s.batch_id).in_(chunk)
                for row in session.scalars(select(s).where(in_chunk)):
                    stats[row.device_id, row.batch_id].append(_stats(row))
                in_chunk = tuple_(i.device_id, i.batch_id).in_(chunk)
                for row in session.scalars(select(i).where(in_chunk)):
                    installs[row.device_id, row.batch_id].append(_install(row))
            return [
                PendingBatch(
                    r.device_id,
                    r.batch_id,
                    aware(r.period_end),
                    dict(r.attributes),
                    tuple(stats[r.device_id, r.batch_id]),
                    tuple(installs[r.device_id, r.batch_id]),
                )
                for r in rows
            ]

    def apply_rollups(
        self,
        batches: list[tuple[str, str]],
        deltas: dict[tuple[int, dt.datetime, RollupKey], Aggregate],
        cohort_devices: list[CohortDevice],
    ) -> bool:
        """Merge `deltas` and mark `batches` rolled in one transaction; False if beaten."""
        with self._scope() as session:
            pg = session.get_bind().dialect.name == "postgresql"
            if pg:
                session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _ROLLER_LOCK})
            b = orm.TelemetryBatchRow
            claimed = 0
            if pg:
                devices, batch_ids = zip(*batches, strict=True) if batches else ((), ())
                claimed = session.execute(
                    _CLAIM_PG, {"devices": list(devices), "batches": list(batch_ids)}
                ).rowcount
            for chunk in _chunks(batches) if not pg else ():
                claimed += session.execute(
                    update(b)
                    .where(b.rolled.is_(False), tuple_(b.device_id, b.batch_id).in_(chunk))
                    .values(rolled=True)
                    .execution_options(synchronize_session=False)
                ).rowcount
            if claimed != len(batches):
                session.rollback()
                return False
            _merge_rows(session, deltas)
            _upsert_cohort_devices(session, postgresql if pg else sqlite, cohort_devices)
            return True

    def prune_telemetry(
        self,
        *,
        raw_before: dt.datetime,
        batches_before: dt.datetime,
        installs_before: dt.datetime,
        cutoffs: dict[int, dt.datetime],
    ) -> dict[str, int]:
        """Delete old rolled raw batches (with their stats) and old rollups."""
        b, s, i = orm.TelemetryBatchRow, orm.ModelStatsRow, orm.InstallReportRow
        gone: dict[str, int] = {}
        with self._scope() as session:
            # Stats of batches not rolled yet stay, however old (the roller needs them).
            unrolled = select(b.device_id, b.batch_id).where(b.rolled.is_(False))
            gone["model_stats"] = session.execute(
                delete(s).where(
                    s.period_end < raw_before,
                    tuple_(s.device_id, s.batch_id).not_in(unrolled),
                )
            ).rowcount
            gone["install_reports"] = session.execute(
                delete(i).where(
                    i.at < installs_before,
                    tuple_(i.device_id, i.batch_id).not_in(unrolled),
                )
            ).rowcount
            gone["batches"] = session.execute(
                delete(b).where(b.rolled.is_(True), b.received_at < batches_before)
            ).rowcount
            gone["rollups"] = 0
            # Cohort devices not seen for as long as any rollup is kept.
            oldest = min(cutoffs.values())
            d = orm.RolloutDeviceRow
            gone["cohort_devices"] = session.execute(delete(d).where(d.last_seen < oldest)).rowcount
            for resolution, cutoff in cutoffs.items():
                gone["rollups"] += session.execute(
                    delete(_R).where(_R.c.resolution_s == resolution, _R.c.bucket_start < cutoff)
                ).rowcount
        return gone

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
        """Merge rollup rows per `group(bucket_start, key)`."""
        c = _R.c
        stmt = select(
            c.bucket_start,
            c.model,
            c.version,
            c.variant,
            c.config,
            c.device_class,
            c.rollout,
            c.cohort,
            *(c[name] for name in _MERGED),
        ).where(c.resolution_s == resolution_s, c.bucket_start >= since)
        if until is not None:
            stmt = stmt.where(c.bucket_start < until)
        stmt = stmt.where(c.rollout == (rollout or ""))
        if model is not None:
            stmt = stmt.where(c.model == model)
        if version is not None:
            stmt = stmt.where(c.version == version)
        merged: dict[Hashable, Aggregate] = {}
        parts: dict[Hashable, tuple[list, list]] = {}
        n_counters = len(COUNTERS)
        with self._read_connection() as conn:
            for row in conn.execute(stmt):
                key = RollupKey(*row[1:8])
                g = group(aware(row[0]), key)
                if g is None:
                    continue
                agg = merged.get(g)
                if agg is None:
                    agg = merged[g] = Aggregate()
                    parts[g] = ([], [])
                values = row[8 : 8 + n_counters]
                for name, value in zip(COUNTERS, values, strict=True):
                    setattr(agg, name, getattr(agg, name) + value)
                signals, count, sum_ns, low, high, blob = row[8 + n_counters :]
                if signals:
                    agg.crash_signals.update(signals)
                if count:
                    agg._add_latency(count, sum_ns, low, high)
                    index, counts = decode_buckets(blob)
                    parts[g][0].append(index)
                    parts[g][1].append(counts)
        for g, (indexes, counts) in parts.items():
            if indexes:
                merged[g].buckets = _sum_sparse(indexes, counts)
        return merged

    def cohort_device_counts(
        self, rollout: str, *, since: dt.datetime
    ) -> list[tuple[str, str, int, dict[str, int]]]:
        """Return (cohort, device_class, devices, devices with each incident kind)."""
        d = orm.RolloutDeviceRow
        with_any = [func.sum(case((d.__table__.c[k] > 0, 1), else_=0)) for k in INCIDENTS]
        with self._read() as session:
            return [
                (
                    cohort,
                    device_class,
                    n,
                    dict(zip(INCIDENTS, (int(x or 0) for x in rest), strict=True)),
                )
                for cohort, device_class, n, *rest in session.execute(
                    select(d.cohort, d.device_class, func.count(), *with_any)
                    .where(d.rollout == rollout, d.last_seen >= since)
                    .group_by(d.cohort, d.device_class)
                )
            ]


def _sum_sparse(indexes: list[np.ndarray], counts: list[np.ndarray]) -> np.ndarray:
    # float64: a read merges up to many thousands of rows, each up to INT64_MAX; quantile
    # ranks do not need more than float precision, and floats do not wrap.
    index = np.concatenate(indexes).astype(np.intp)
    count = np.concatenate(counts).astype(np.float64)
    return np.bincount(index, weights=count, minlength=N_BUCKETS)[:N_BUCKETS]


def _values(agg: Aggregate) -> dict:
    out = {name: clamp(getattr(agg, name)) for name in COUNTERS}
    out.update(
        crash_signals={k: clamp(v) for k, v in agg.crash_signals.items()},
        latency_count=clamp(agg.latency_count),
        latency_sum_ns=clamp(agg.latency_sum_ns),
        latency_min_ns=agg.latency_min_ns,
        latency_max_ns=agg.latency_max_ns,
        latency_buckets=encode_buckets(agg.buckets),
    )
    return out


def _merge_rows(session, deltas: dict[tuple[int, dt.datetime, RollupKey], Aggregate]) -> None:
    """Add each delta to its row (read, merge, write), or insert the row."""
    digests = {(res, start, key.digest): (key, agg) for (res, start, key), agg in deltas.items()}
    existing: dict[tuple, Aggregate] = {}
    c = _R.c
    wanted = list(digests)
    for chunk in _chunks(wanted):
        rows = session.execute(
            select(c.resolution_s, c.bucket_start, c.key, *(c[name] for name in _MERGED)).where(
                tuple_(c.resolution_s, c.bucket_start, c.key).in_([(r, s, k) for r, s, k in chunk])
            )
        ).all()
        for row in rows:
            agg = Aggregate(**dict(zip(COUNTERS, row[3 : 3 + len(COUNTERS)], strict=True)))
            signals, count, sum_ns, low, high, blob = row[3 + len(COUNTERS) :]
            agg.crash_signals.update(signals or {})
            if count:
                agg._add_latency(count, sum_ns, low, high)
                index, counts = decode_buckets(blob)
                stored = np.zeros(N_BUCKETS, np.int64)
                stored[index.astype(np.intp)] = counts  # indexes are unique within a row
                agg.buckets = stored
            existing[row.resolution_s, aware(row.bucket_start), row.key] = agg
    rows = []
    for ident, (key, delta) in digests.items():
        found = existing.get(ident)
        if found is not None:
            found.merge(delta)
            delta = found
        res, start, digest = ident
        rows.append(
            {
                "resolution_s": res,
                "bucket_start": start,
                "key": digest,
                "model": key.model,
                "version": key.version,
                "variant": key.variant,
                "config": key.config,
                "device_class": key.device_class,
                "rollout": key.rollout,
                "cohort": key.cohort,
                **_values(delta),
            }
        )
    new = [row for ident, row in zip(digests, rows, strict=True) if ident not in existing]
    if new:
        session.execute(_R.insert(), new)
    changed = [
        {"b_" + name: row[name] for name in ("resolution_s", "bucket_start", "key", *_MERGED)}
        for ident, row in zip(digests, rows, strict=True)
        if ident in existing
    ]
    if changed:
        session.execute(_UPDATE, changed)


def _upsert_cohort_devices(session, dialect, devices: list[CohortDevice]) -> None:
    """Record cohort devices: latest class and time, incidents added up (saturating)."""
    merged: dict[tuple, dict] = {}
    for d in devices:
        k = (d.rollout, d.cohort, d.device_id)
        row = merged.get(k)
        if row is None:
            row = merged[k] = {
                "rollout": d.rollout,
                "cohort": d.cohort,
                "device_id": d.device_id,
                "device_class": d.device_class,
                "last_seen": d.last_seen,
                **{name: 0 for name in INCIDENTS},
            }
        elif row["last_seen"] < d.last_seen:
            row["device_class"], row["last_seen"] = d.device_class, d.last_seen
        for name in INCIDENTS:
            row[name] = clamp(row[name] + getattr(d, name))
    if not merged:
        return
    table = orm.RolloutDeviceRow.__table__
    insert = dialect.insert(table)
    newer = insert.excluded.last_seen > table.c.last_seen
    big = 2**62  # both sides stay below it: their sum fits a BIGINT
    for chunk in _chunks(list(merged.values())):
        session.execute(
            insert.on_conflict_do_update(
                index_elements=["rollout", "cohort", "device_id"],
                set_={
                    "device_class": case(
                        (newer, insert.excluded.device_class), else_=table.c.device_class
                    ),
                    "last_seen": case((newer, insert.excluded.last_seen), else_=table.c.last_seen),
                    **{
                        name: _saturating_sum(table.c[name], insert.excluded[name], big)
                        for name in INCIDENTS
                    },
                },
            ),
            chunk,
        )


def _saturating_sum(stored, added, big: int):
    """Return SQL for stored + added that stays within a BIGINT (sticks past `big`)."""
    return case(
        (stored >= big, stored),
        else_=stored + case((added >= big, big), else_=added),
    )
