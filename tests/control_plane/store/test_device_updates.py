"""The write-behind flush writes only what changed (SQLite and PostgreSQL).

A device that reports what it reported before must cost no rewrite of its model rows:
under a Sync storm those rewrites dominated PostgreSQL's time (issue 24's scale run).
"""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import text

from contract.key_wrap import DeviceKeyPair
from control_plane.fleet.devices import Fleet
from control_plane.store.fleet import DeviceUpdate, ModelState
from control_plane.store.report_records import InstallRecord, ReportBatch
from control_plane.store.sql_store import SqlStore

T0 = dt.datetime(2026, 11, 1, tzinfo=dt.UTC)


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


def _devices(store, n: int) -> list[str]:
    fleet = Fleet(store, default_enroll_ttl_s=3600)
    token = fleet.create_enrollment_token(actor="t", attributes={}).token
    keys = DeviceKeyPair.generate().public_keyset()
    return [
        fleet.enroll(token=token, attributes={"platform": "android"}, public_keyset=keys)[0].id
        for _ in range(n)
    ]


def _rows(store, device_id: str) -> dict[str, tuple]:
    """model -> (installed version, variant, reported_at[, xmin on PostgreSQL])."""
    xmin = ", xmin::text" if store.dialect == "postgresql" else ""
    with store._engine.connect() as conn:
        found = conn.execute(
            text(
                "SELECT model, installed_version, installed_variant, reported_at"
                f"{xmin} FROM device_models WHERE device_id = :d"
            ),
            {"d": device_id},
        ).all()
    return {r[0]: tuple(r[1:]) for r in found}


def _report(store, device_id, at, *models):
    store.apply_device_updates(
        [DeviceUpdate(device_id, at, installed=tuple(ModelState(*m) for m in models))]
    )


def test_an_unchanged_report_rewrites_no_model_row(store):
    (d,) = _devices(store, 1)
    _report(store, d, T0, ("det", 1, "fp32"), ("ocr", 2, "int8"))
    first = _rows(store, d)
    _report(store, d, T0 + dt.timedelta(minutes=5), ("det", 1, "fp32"), ("ocr", 2, "int8"))
    # Same stamp (and on PostgreSQL the same row version, xmin): nothing was rewritten.
    assert _rows(store, d) == first
    assert store.get_device(d).installed == (
        ModelState("det", 1, "fp32"),
        ModelState("ocr", 2, "int8"),
    )
    assert store.get_device(d).last_seen == T0 + dt.timedelta(minutes=5)


def test_changes_are_written_and_dropped_models_cleared(store):
    a, b = _devices(store, 2)
    _report(store, a, T0, ("det", 1, "fp32"), ("ocr", 2, "int8"))
    _report(store, b, T0, ("det", 1, "fp32"))
    before_a, before_b = _rows(store, a), _rows(store, b)
    later = T0 + dt.timedelta(minutes=1)
    store.apply_device_updates(
        [
            # det moved to v2; ocr no longer installed.
            DeviceUpdate(a, later, installed=(ModelState("det", 2, "fp32"),)),
            DeviceUpdate(b, later, installed=(ModelState("det", 1, "fp32"),)),
        ]
    )
    rows = _rows(store, a)
    assert rows["det"][:2] == (2, "fp32") and rows["det"][2] != before_a["det"][2]  # stamped
    assert rows["ocr"][:2] == (None, None)
    assert store.get_device(a).installed == (ModelState("det", 2, "fp32"),)
    assert _rows(store, b) == before_b  # b's report, unchanged, in the same flush
    # A variant change alone is a change.
    _report(store, b, later, ("det", 1, "int8"))
    assert store.get_device(b).installed == (ModelState("det", 1, "int8"),)
    # Reporting nothing clears everything.
    _report(store, b, later)
    assert store.get_device(b).installed == ()


def test_a_big_flush_is_split_under_the_parameter_limit(store):
    ids = _devices(store, 3)
    models = [(f"m{i:03d}", 1, "fp32") for i in range(256)]
    updates = [DeviceUpdate(d, T0, installed=tuple(ModelState(*m) for m in models)) for d in ids]
    store.apply_device_updates(updates)
    # Every device drops half its models in one flush: several clearing statements.
    from control_plane.store import sql_fleet

    limit = sql_fleet._STATEMENT_PARAMETERS
    sql_fleet._STATEMENT_PARAMETERS = 600  # two devices' worth, to make it split here
    try:
        store.apply_device_updates(
            [
                DeviceUpdate(d, T0, installed=tuple(ModelState(*m) for m in models[:128]))
                for d in ids
            ]
        )
    finally:
        sql_fleet._STATEMENT_PARAMETERS = limit
    for d in ids:
        assert [s.model for s in store.get_device(d).installed] == [m[0] for m in models[:128]]


def test_a_late_install_report_is_undone_by_the_next_sync(store):
    # Unchanged Syncs no longer restamp a model's row, so a report of an older
    # activation arriving late (a drained queue) may move the row back; the device's
    # next Sync, which reports what it runs, differs from the row and is written.
    (d,) = _devices(store, 1)
    v2 = ("det", 2, "fp32")
    for minute in range(11):  # ten minutes of Syncs, each saying det:2 is installed
        _report(store, d, T0 + dt.timedelta(minutes=minute), v2)
    at = T0 + dt.timedelta(minutes=5)
    install = InstallRecord(at, "det", 1, "fp32", "r1", "activated")
    later = T0 + dt.timedelta(minutes=11)
    store.add_report(ReportBatch(d, "batch-0001", later, at, at, 0, (), (install,)))
    _report(store, d, later + dt.timedelta(seconds=30), v2)
    assert store.get_device(d).installed == (ModelState(*v2),)


ODD = {
    "platform": "android",
    "app_version": "5.3 \u00e9\u2028\U0001f600",
    "ram_mb": 8192,
    "tags": ["beta", "\u00fcber"],
    "custom": {"k\u00e9y": 'v"al\\ue', "z": "", "a": "1.0"},
}


def test_fleet_attributes_read_as_text_equal_the_orm_reading(store):
    """live_device_attributes reads the stored JSON text itself (no ORM row processing)."""
    a, b = _devices(store, 2)
    store.apply_device_updates([DeviceUpdate(a, T0, attributes=ODD)])
    live = dict(store.live_device_attributes())
    assert live[a] == store.get_device(a).attributes == ODD
    # Each device gets objects of its own: a caller changing one changes nothing else.
    live[a]["tags"].append("tampered")
    live[b]["platform"] = "tampered"
    assert dict(store.live_device_attributes()) == {a: ODD, b: {"platform": "android"}}


def test_fleet_attributes_of_a_revoked_device_are_not_read(store):
    a, b = _devices(store, 2)
    store.revoke_device(a, at=T0, reason="lost")
    assert [i for i, _ in store.live_device_attributes()] == [b]


def test_watch_states_read_many_devices_as_get_device_reads_each(store):
    """What a Watch stream reads for its device, read for many at once (a reconnect storm)."""
    ids = _devices(store, 3)
    many = ids + [f"dev_missing_{i}" for i in range(1200)]  # over the 500-id chunk, twice
    a, b, c = ids
    store.apply_device_updates(
        [
            DeviceUpdate(a, T0, attributes=ODD, synced=(ModelState("z", 2, "q8"),)),
            DeviceUpdate(a, T0, synced=(ModelState("z", 2, "q8"), ModelState("det", 1, ""))),
            DeviceUpdate(b, T0, installed=(ModelState("det", 3, "fp32"),)),  # not synced
        ]
    )
    store.revoke_device(c, at=T0, reason="lost")
    states = store.watch_states(many)
    assert sorted(states) == sorted(ids)  # unknown ids are left out, revoked ones are not
    for device_id, state in states.items():
        record = store.get_device(device_id)
        assert state.attributes == record.attributes
        assert state.revoked == (record.revoked_at is not None)
        assert state.synced == record.synced
    assert states[a].synced == (ModelState("det", 1, ""), ModelState("z", 2, "q8"))
    assert states[b].synced == () and states[c].revoked and not states[a].revoked
    assert store.watch_states([]) == {}
