"""Bulk writes straight to the driver store what SQLAlchemy's own executemany would."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from contract import errors
from control_plane.store import orm
from control_plane.store.rollup_aggregate import COUNTERS
from control_plane.store.sql_bulk import Bulk
from control_plane.store.sql_store import SqlStore

_D = orm.DeviceRollupRow.__table__
KEY = ("key", "scope", "window_start", "cohort", "model", "version", "variant", "config")
VALUES = tuple(c.name for c in _D.columns if c.name not in {"id", *KEY})
WHEN = dt.datetime(2026, 11, 27, 9, 30, 15, 123456, tzinfo=dt.UTC)


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    with s._scope() as session:  # the devices the rows are of
        session.execute(
            orm.DeviceRow.__table__.insert(),
            [
                {
                    "id": f"dev_{i:016x}",
                    "credential_sha256": f"{i:064x}",
                    "public_keyset": b"k",
                    "attributes": {},
                    "stamped_attributes": {},
                    "enrollment_token_id": "t",
                    "enrolled_at": WHEN,
                }
                for i in range(64)
            ],
        )
    yield s
    s.close()


def _row(i: int, **changes) -> dict:
    row = {
        "key": f"k{i:04d}",
        "scope": "ro_1",
        "window_start": WHEN - dt.timedelta(days=i),
        "cohort": "candidate",
        "model": "det",
        "version": 2,
        "variant": "fp32",
        "config": "CPU/normal/t4/mem-normal",
        "device_id": f"dev_{i:016x}",
        "device_class": '{"soc": "sm8450"}',
        "last_seen": WHEN,
        "reports": i,
        "crash_signals": {"SIGSEGV": i} if i % 2 else {},
        "latency_min_ns": None if i % 3 else 1000 + i,
        "latency_buckets": bytes([i % 256, 0]),
        **dict.fromkeys(COUNTERS, i + 1),
        "latency_count": i,
        "latency_sum_ns": 3000 * i,
        "latency_max_ns": 5000 + i,
        "ttft_count": 0,
        "ttft_sum_ns": 0,
        "ttft_min_ns": None,
        "ttft_max_ns": None,
        "ttft_buckets": b"",
        **changes,
    }
    return row


def _stored(store) -> dict[str, dict]:
    with store._scope() as session:
        rows = session.execute(select(_D)).mappings().all()
    return {r["key"]: {name: r[name] for name in (*KEY, *VALUES)} for r in rows}


def _aware(rows: dict[str, dict]) -> dict[str, dict]:
    """Times as the store compares them (SQLite keeps them without a zone)."""
    for row in rows.values():
        for name in ("window_start", "last_seen"):
            row[name] = row[name].replace(tzinfo=dt.UTC)
    return rows


def test_rows_written_in_bulk_read_back_as_sqlalchemy_wrote_them(store):
    expected = {r["key"]: r for r in (_row(i) for i in range(7))}
    insert = Bulk.insert(_D, (*KEY, *VALUES))
    with store._scope() as session:
        insert.run(session, [tuple(r[c] for c in (*KEY, *VALUES)) for r in expected.values()])
    assert _aware(_stored(store)) == expected

    # Updates matched by key; a filter on a time column matches the stored text (SQLite).
    update = Bulk.update(_D, ("reports", "crash_signals", "last_seen"), ("key",))
    later = WHEN + dt.timedelta(hours=1)
    with store._scope() as session:
        update.run(session, [(100 + i, {"SIGABRT": 1}, later, f"k{i:04d}") for i in (1, 4)])
        found = session.execute(
            select(_D.c.key).where(_D.c.window_start >= WHEN - dt.timedelta(days=2))
        ).scalars()
        assert sorted(found) == ["k0000", "k0001", "k0002"]
    for i in (1, 4):
        expected[f"k{i:04d}"].update(reports=100 + i, crash_signals={"SIGABRT": 1}, last_seen=later)
    assert _aware(_stored(store)) == expected

    # Same model of SQLAlchemy's own insert beside it: identical stored values.
    twin = _row(50)
    with store._scope() as session:
        session.execute(_D.insert(), [twin])
    stored = _aware(_stored(store))
    assert stored["k0050"] == twin


def test_a_refused_bulk_write_leaves_nothing_and_names_the_problem(store):
    insert = Bulk.insert(_D, (*KEY, *VALUES))
    columns = (*KEY, *VALUES)
    rows = [tuple(_row(i)[c] for c in columns) for i in (1, 2)]
    with store._scope() as session:
        insert.run(session, rows[:1])
    with pytest.raises(errors.AlreadyExists), store._scope() as session:
        insert.run(session, rows[1:])  # new
        insert.run(session, rows[:1])  # the same key again: refused by the unique index
    assert list(_stored(store)) == ["k0001"]  # the whole transaction rolled back


def test_a_statement_with_columns_left_to_defaults_is_refused_before_it_runs(store):
    bulk = Bulk.insert(_D, KEY)  # the counters have defaults only SQLAlchemy would fill in
    with pytest.raises(ValueError, match="give values for .*inferences"), store._scope() as s:
        bulk.run(s, [tuple(_row(1)[c] for c in KEY)])
