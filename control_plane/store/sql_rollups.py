"""SQL implementation of the rollup store, mixed into `SqlStore` (one engine, one scope)."""

from __future__ import annotations

import collections
import datetime as dt
from collections.abc import Callable, Hashable
from dataclasses import replace

import numpy as np
from sqlalchemy import (
    and_,
    delete,
    func,
    or_,
    select,
    text,
    true,
    tuple_,
    update,
)

from control_plane.store import orm
from control_plane.store.device_table import LEAN_SKIPS, DeviceTable
from control_plane.store.rollup_aggregate import (
    COUNTERS,
    INT64_MAX,
    Aggregate,
    clamp,
    decode_buckets,
    encode_buckets,
)
from control_plane.store.rollup_records import (
    FLEET,
    DeviceDelta,
    DeviceKey,
    DeviceRollup,
    PendingBatch,
    RollupKey,
    RollupStore,
)
from control_plane.store.sql_bulk import Bulk
from control_plane.store.sql_device_table import read_device_table
from control_plane.store.sql_fleet import aware
from control_plane.store.sql_report_rows import install_record, stats_record
from runtime.histogram import N_BUCKETS

_CHUNK = 500  # keys per IN (...) list
# A language model's time to first token: a second histogram on the same rows.
TTFT_COLUMNS = ("ttft_count", "ttft_sum_ns", "ttft_min_ns", "ttft_max_ns", "ttft_buckets")
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
    *TTFT_COLUMNS,
)
_ROLLUP_KEY = ("resolution_s", "bucket_start", "key")
_GROUP = ("model", "version", "variant", "config", "device_class", "rollout", "cohort")
_INSERT_ROLLUPS = Bulk.insert(_R, (*_ROLLUP_KEY, *_GROUP, *_MERGED))
_UPDATE_ROLLUPS = Bulk.update(_R, _MERGED, _ROLLUP_KEY)
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
                    stats[row.device_id, row.batch_id].append(stats_record(row))
                in_chunk = tuple_(i.device_id, i.batch_id).in_(chunk)
                for row in session.scalars(select(i).where(in_chunk)):
                    installs[row.device_id, row.batch_id].append(install_record(row))
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
        device_deltas: dict[DeviceKey, DeviceDelta],
    ) -> bool:
        """Merge the deltas and mark `batches` rolled in one transaction; False if beaten."""
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
            _merge_device_rows(session, device_deltas)
            return True

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
        """Delete old rolled raw batches (with their stats), old rollups and device rows."""
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
            d = orm.DeviceRollupRow
            gone["device_rollups"] = session.execute(
                delete(d).where(
                    or_(
                        and_(d.scope != FLEET, d.last_seen < rollout_devices_before),
                        and_(d.scope == FLEET, d.last_seen < fleet_devices_before),
                    )
                )
            ).rowcount
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
                signals, count, sum_ns, low, high, blob = row[8 + n_counters : 14 + n_counters]
                if signals:
                    agg.crash_signals.update(signals)
                if count:
                    agg._add_latency(count, sum_ns, low, high)
                    index, counts = decode_buckets(blob)
                    parts[g][0].append(index)
                    parts[g][1].append(counts)
                ttft = _stored_ttft(row[14 + n_counters :])
                if ttft is not None:
                    if agg.ttft is None:
                        agg.ttft = Aggregate()
                    agg.ttft.merge(ttft)
        for g, (indexes, counts) in parts.items():
            if indexes:
                merged[g].buckets = _sum_sparse(indexes, counts)
        return merged

    def cohort_totals(self, scope: str, cohort: str) -> tuple[int, int]:
        """Return (reports, distinct devices) of one cohort's rows over every window."""
        c = _D.c
        with self._read_connection() as conn:
            reports, devices = conn.execute(
                select(
                    func.coalesce(func.sum(c.reports), 0), func.count(c.device_id.distinct())
                ).where(c.scope == scope, c.cohort == cohort)
            ).one()
        return int(reports), int(devices)

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
        """Return the device rows of one scope as columns (one pass over the rows)."""
        c = _D.c
        where = [c.scope == scope]
        if model is not None:
            where.append(c.model == model)
        if version is not None:
            where.append(c.version == version)
        if seen_since is not None:
            where.append(c.last_seen >= seen_since)
        if windows_since is not None:
            where.append(c.window_start >= windows_since)
        if windows_before is not None:
            where.append(c.window_start < windows_before)
        if cohorts is not None:
            # With the scope, the leading columns of ix_device_rollups_cohort: a health
            # view reads its window's rows alone, not every window of the rollout.
            where.append(c.cohort.in_(cohorts))
        with self._read_connection() as conn:
            return read_device_table(conn, scope, _LEAN_READ if lean else _TABLE_READ, where)


def _sum_sparse(indexes: list[np.ndarray], counts: list[np.ndarray]) -> np.ndarray:
    # float64: a read merges up to many thousands of rows, each up to INT64_MAX; quantile
    # ranks do not need more than float precision, and floats do not wrap.
    index = np.concatenate(indexes).astype(np.intp)
    count = np.concatenate(counts).astype(np.float64)
    return np.bincount(index, weights=count, minlength=N_BUCKETS)[:N_BUCKETS]


def _values(agg: Aggregate) -> tuple:
    """Return what a row stores of `agg`: the `_MERGED` columns, in that order."""
    ttft = agg.ttft
    return (
        *(min(getattr(agg, name), INT64_MAX) for name in COUNTERS),  # clamp, inline
        {k: clamp(v) for k, v in agg.crash_signals.items()},
        clamp(agg.latency_count),
        clamp(agg.latency_sum_ns),
        agg.latency_min_ns,
        agg.latency_max_ns,
        encode_buckets(agg.buckets),
        *(
            _NO_TTFT
            if ttft is None
            else (
                clamp(ttft.latency_count),
                clamp(ttft.latency_sum_ns),
                ttft.latency_min_ns,
                ttft.latency_max_ns,
                encode_buckets(ttft.buckets),
            )
        ),
    )


# What a row without time to first token stores (most rows: every model not a language
# one), as TTFT_COLUMNS.
_NO_TTFT = (0, 0, None, None, b"")


def _stored_ttft(values) -> Aggregate | None:
    """Return the time to first token a row stores (`TTFT_COLUMNS`), None when none."""
    count, sum_ns, low, high, blob = values
    if not count:
        return None
    agg = Aggregate()
    agg._add_latency(count, sum_ns, low, high)
    index, counts = decode_buckets(blob)
    agg.buckets[index.astype(np.intp)] = counts
    return agg


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
            signals, count, sum_ns, low, high, blob = row[3 + len(COUNTERS) : 9 + len(COUNTERS)]
            agg.ttft = _stored_ttft(row[9 + len(COUNTERS) :])
            agg.crash_signals.update(signals or {})
            if count:
                agg._add_latency(count, sum_ns, low, high)
                index, counts = decode_buckets(blob)
                stored = np.zeros(N_BUCKETS, np.int64)
                stored[index.astype(np.intp)] = counts  # indexes are unique within a row
                agg.buckets = stored
            existing[row.resolution_s, aware(row.bucket_start), row.key] = agg
    new, changed = [], []
    for ident, (key, delta) in digests.items():
        found = existing.get(ident)
        if found is None:
            group = (key.model, key.version, key.variant, key.config, key.device_class)
            new.append((*ident, *group, key.rollout, key.cohort, *_values(delta)))
        else:
            found.merge(delta)
            changed.append((*_values(found), *ident))
    _INSERT_ROLLUPS.run(session, new)
    _UPDATE_ROLLUPS.run(session, changed)


_D = orm.DeviceRollupRow.__table__
_DEVICE_KEY = (
    "scope",
    "window_start",
    "cohort",
    "model",
    "version",
    "variant",
    "config",
    "device_id",
)
_DEVICE_VALUES = ("device_class", "last_seen", "reports", *_MERGED)
_DEVICE_READ = (*_DEVICE_KEY, *_DEVICE_VALUES)
# What `device_table` reads: the scope is the one asked for; a lean table leaves out more
# (each column costs a health view ~1 ms per 10k rows to fetch, more to convert).
_TABLE_READ = tuple(name for name in _DEVICE_READ if name != "scope")
_LEAN_READ = tuple(name for name in _TABLE_READ if name not in LEAN_SKIPS)
_INSERT_DEVICE_ROWS = Bulk.insert(_D, ("key", *_DEVICE_KEY, *_DEVICE_VALUES))
_UPDATE_DEVICE_ROWS = Bulk.update(_D, _DEVICE_VALUES, ("key",))
_EMPTY_INDEX = np.zeros(0, "<u2")
_EMPTY_COUNTS = np.zeros(0, "<i8")


def _device_rollup(row) -> DeviceRollup:
    values = dict(zip(_DEVICE_READ, row, strict=True))
    key = DeviceKey(*(values[name] for name in _DEVICE_KEY))
    key = replace(key, window=aware(key.window))
    if values["latency_count"]:
        index, counts = decode_buckets(values["latency_buckets"])
    else:
        index, counts = _EMPTY_INDEX, _EMPTY_COUNTS
    return DeviceRollup(
        key=key,
        device_class=values["device_class"],
        last_seen=aware(values["last_seen"]),
        reports=values["reports"],
        counters={name: values[name] for name in COUNTERS},
        crash_signals=dict(values["crash_signals"] or {}),
        latency_count=values["latency_count"],
        latency_sum_ns=values["latency_sum_ns"],
        latency_min_ns=values["latency_min_ns"],
        latency_max_ns=values["latency_max_ns"],
        index=index,
        counts=counts,
        ttft=_stored_ttft([values[name] for name in TTFT_COLUMNS]),
    )


def _merge_device_rows(session, deltas: dict[DeviceKey, DeviceDelta]) -> None:
    """Add each device delta to its row (read, merge, write), or insert the row."""
    by_digest = {key.digest: (key, delta) for key, delta in deltas.items()}
    existing: dict[str, DeviceRollup] = {}
    for chunk in _chunks(list(by_digest)):
        for row in session.execute(
            select(_D.c.key, *(_D.c[name] for name in _DEVICE_READ)).where(_D.c.key.in_(chunk))
        ):
            existing[row[0]] = _device_rollup(row[1:])
    new, changed = [], []
    for digest, (key, delta) in by_digest.items():
        found = existing.get(digest)
        agg, reports = delta.aggregate, delta.reports
        device_class, last_seen = delta.device_class, delta.last_seen
        if found is not None:
            stored = found.aggregate()
            stored.merge(agg)
            agg, reports = stored, clamp(found.reports + reports)
            if found.last_seen > last_seen:
                device_class, last_seen = found.device_class, found.last_seen
        values = (device_class, last_seen, reports, *_values(agg))
        if found is None:
            key_values = (
                key.scope,
                key.window,
                key.cohort,
                key.model,
                key.version,
                key.variant,
                key.config,
                key.device_id,
            )
            new.append((digest, *key_values, *values))
        else:
            changed.append((*values, digest))
    _INSERT_DEVICE_ROWS.run(session, new)
    _UPDATE_DEVICE_ROWS.run(session, changed)
