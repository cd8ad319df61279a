"""A scope's device rows read as columns (`SqlRollupStore.device_table`).

A rollout's health view or a version's backend table reads tens of thousands of device
rows (control_plane.store.device_table.DeviceTable): they are selected in the form
cheapest to read (`_table_columns`), taken as the driver's own tuples, and turned into
columns in one pass (`_table`).
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from types import MappingProxyType

import numpy as np
from sqlalchemy import Double, String, Text, cast, func, select
from sqlalchemy import exc as sa_exc

from control_plane.gc_tuning import collector_held
from control_plane.store import orm
from control_plane.store.device_table import DeviceTable, decode_many
from control_plane.store.rollup_aggregate import COUNTERS
from control_plane.store.sql_fleet import aware

_D = orm.DeviceRollupRow.__table__
# What a row without crashes holds: one read-only mapping for all of them, not an empty
# dict each (20k of them a health view: 1.3 MB while it lives, half the loop's time).
_NO_SIGNALS: Mapping[str, int] = MappingProxyType({})


def read_device_table(conn, scope: str, names: tuple[str, ...], where: list) -> DeviceTable:
    """Return the columns `names` of the rows of `scope` that `where` selects, as a table."""
    pg = conn.dialect.name == "postgresql"
    stmt = select(*_table_columns(pg, names)).where(*where)
    with _executed(conn, stmt, pg) as cursor:
        # From the rows' first tuple until `_table` has freed the last, not while the
        # query waits or starts (control_plane.gc_tuning); SQLite's scan itself runs as
        # its rows are fetched.
        with collector_held():
            return _table(scope, names, cursor.fetchall(), pg)


@contextmanager
def _executed(conn, stmt, pg: bool) -> Iterator:
    """Yield a DB-API cursor that has run `stmt`, to fetch its rows as the driver's tuples.

    The selected columns need no processing (`_table_columns`), so no Row is made of each
    (~1.5 us a row: 60 ms of a 40k-row health view). On SQLite, bound values are converted
    as SQLAlchemy stores them (a datetime's text). PostgreSQL sends the rows in binary: no
    text parsed per cell, and bytea as stored, not hex-encoded (a fifth less time to fetch
    a health view's rows); its bound values (strings, integers, aware datetimes) need no
    processing there, psycopg adapts them. The driver's errors, from running or fetching,
    come out sorted as SQLAlchemy's (SQLite reads rows as it fetches).
    """
    dbapi_error = conn.dialect.loaded_dbapi.Error
    try:
        if pg:
            # IN lists as one placeholder per value (SQLAlchemy expands them at run time).
            compiled = stmt.compile(
                dialect=conn.dialect, compile_kwargs={"render_postcompile": True}
            )
            with conn.connection.driver_connection.cursor(binary=True) as cursor:
                cursor.execute(compiled.string, compiled.params)
                yield cursor
            return
        result = conn.execute(stmt)
        try:
            yield result.cursor
        finally:
            result.close()
    except dbapi_error as exc:
        raise sa_exc.DBAPIError.instance(str(stmt), None, exc, dbapi_error) from exc


def _table_columns(pg: bool, names: tuple[str, ...]) -> list:
    """Return what `device_table` selects: the columns `names`, cheaper to read.

    Times as Unix seconds (or SQLite's text of a window start, a few distinct) and crash
    signals as JSON text, so tens of thousands of rows do not cost a datetime and a JSON
    document each. PostgreSQL's seconds are cast to double precision, as Python's
    float() of the numeric would round them, so the driver makes no Decimal of each.
    """
    c = _D.c
    out = []
    for name in names:
        if name in ("window_start", "last_seen") and pg:
            out.append(cast(func.extract("epoch", c[name]), Double()).label(name))
        elif name == "window_start":
            out.append(cast(c[name], String).label(name))  # few distinct: parsed once each
        elif name == "last_seen":
            out.append(((func.julianday(c[name]) - 2440587.5) * 86400.0).label(name))
        elif name == "crash_signals":
            out.append(cast(c[name], Text).label(name))
        else:
            out.append(c[name])
    return out


def _table(scope: str, names: tuple[str, ...], rows: list, pg: bool) -> DeviceTable:
    """Return rows selected by `_table_columns(pg, names)` as a DeviceTable."""
    columns = dict(zip(names, zip(*rows, strict=True), strict=True)) if rows else {}

    def col(name: str, dtype=object) -> np.ndarray | None:
        if name not in names:  # a lean table's
            return None
        values = columns.get(name, ())
        if dtype is object:
            out = np.empty(len(values), object)
            out[:] = values
            return out
        return np.array(values, dtype)

    def seconds(name: str) -> np.ndarray | None:
        if name not in names:
            return None
        values = columns.get(name, ())
        if pg or name == "last_seen":
            return np.array(values, np.float64)
        parsed: dict[str, float] = {}
        for stored in set(values):
            parsed[stored] = aware(dt.datetime.fromisoformat(stored)).timestamp()
        return np.fromiter(map(parsed.__getitem__, values), np.float64, len(values))

    def nullable(name: str) -> np.ndarray:
        return np.array(columns.get(name, ()), np.float64)  # NumPy makes None NaN

    counters = np.array([columns.get(name, ()) for name in COUNTERS], np.float64)
    signals = col("crash_signals")
    signals[:] = [json.loads(v) if v and v != "{}" else _NO_SIGNALS for v in signals]

    def latency(prefix: str) -> dict[str, np.ndarray]:
        """Return the columns of one histogram (`latency_*`, `ttft_*`) as the latency fields."""
        hist_row, hist_index, hist_count = decode_many(columns.get(f"{prefix}_buckets", ()))
        return {
            "latency_count": col(f"{prefix}_count", np.float64),
            "latency_sum_ns": col(f"{prefix}_sum_ns", np.float64),
            "latency_min_ns": nullable(f"{prefix}_min_ns"),
            "latency_max_ns": nullable(f"{prefix}_max_ns"),
            "hist_row": hist_row,
            "hist_index": hist_index,
            "hist_count": hist_count,
        }

    table = DeviceTable(
        scope=scope,
        window=seconds("window_start"),
        cohort=col("cohort"),
        model=col("model"),
        version=col("version", np.int64),
        variant=col("variant"),
        config=col("config"),
        device_id=col("device_id"),
        device_class=col("device_class"),
        last_seen=seconds("last_seen"),
        reports=col("reports", np.int64),
        counters=counters.T.reshape(len(rows), len(COUNTERS)),
        crash_signals=signals,
        **latency("latency"),
    )
    if not col("ttft_count", np.float64).any():
        return table
    source = replace(table, **latency("ttft"))
    return table.with_ttft(source)
