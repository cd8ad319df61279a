"""SQL implementation of the fleet store, mixed into `SqlStore` (one engine, one scope)."""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence

from sqlalchemy import Text, bindparam, cast, func, select, text, tuple_, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from contract import errors
from control_plane.store import orm
from control_plane.store.fleet import (
    DeviceAuth,
    DeviceRecord,
    DeviceUpdate,
    EnrollFunc,
    EnrollmentTokenRecord,
    FleetStore,
    ModelState,
    WatchState,
)
from control_plane.store.sql_bulk import Bulk

NOTIFY_CHANNEL = "skiff_fleet"
_DEVICES = orm.DeviceRow.__table__
_MODELS = orm.DeviceModelRow.__table__
# The attributes as stored (JSON text on both databases), parsed by the caller.
_LIVE_ATTRIBUTES = select(_DEVICES.c.id, cast(_DEVICES.c.attributes, Text)).where(
    _DEVICES.c.revoked_at.is_(None)
)
_FIND_DEVICE = select(
    _DEVICES.c.id, _DEVICES.c.public_keyset, _DEVICES.c.revoked_at, _DEVICES.c.stamped_attributes
).where(_DEVICES.c.credential_sha256 == bindparam("digest"))

# What a Watch stream reads of its device (watch_states), compiled once.
_SYNCED_OF = select(
    _MODELS.c.device_id, _MODELS.c.model, _MODELS.c.synced_version, _MODELS.c.synced_variant
).where(
    _MODELS.c.device_id.in_(bindparam("ids", expanding=True)), _MODELS.c.synced_version.is_not(None)
)
_WATCHED = select(_DEVICES.c.id, _DEVICES.c.attributes, _DEVICES.c.revoked_at).where(
    _DEVICES.c.id.in_(bindparam("ids", expanding=True))
)


def aware(value: dt.datetime | None) -> dt.datetime | None:
    """Return `value` as aware UTC (SQLite hands back naive datetimes)."""
    if value is None:
        return None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def bump_revision(session: Session, kind: str, subject: str = "") -> int:
    """Advance the fleet revision inside the caller's transaction and announce it.

    On PostgreSQL the NOTIFY is delivered to every replica's listener when (and only if)
    the transaction commits; SQLite runs one replica, which hears it from `SqlStore`.
    """
    session.execute(update(orm.FleetStateRow).values(revision=orm.FleetStateRow.revision + 1))
    revision = session.scalar(select(orm.FleetStateRow.revision))
    if session.get_bind().dialect.name == "postgresql":
        payload = f"{revision}:{kind}:{subject}"
        session.execute(
            text("SELECT pg_notify(:channel, :payload)"),
            {
                "channel": NOTIFY_CHANNEL,
                "payload": payload,
            },
        )
    session.info.setdefault("changes", []).append((revision, kind, subject))
    return revision


def _states(rows: Sequence[orm.DeviceModelRow], kind: str) -> tuple[ModelState, ...]:
    out = []
    for r in rows:
        version, variant = getattr(r, f"{kind}_version"), getattr(r, f"{kind}_variant")
        if version is not None:
            out.append(ModelState(r.model, version, variant or ""))
    return tuple(sorted(out, key=lambda s: s.model))


def _device(row: orm.DeviceRow, models: Sequence[orm.DeviceModelRow]) -> DeviceRecord:
    return DeviceRecord(
        id=row.id,
        attributes=dict(row.attributes),
        enrolled_at=aware(row.enrolled_at),
        last_seen=aware(row.last_seen),
        online_until=aware(row.online_until),
        revoked_at=aware(row.revoked_at),
        revoked_reason=row.revoked_reason,
        installed=_states(models, "installed"),
        synced=_states(models, "synced"),
        reports_refused=row.reports_refused or 0,
        last_refusal=row.last_refusal or "",
        last_refusal_at=aware(row.last_refusal_at),
        clock_offset_s=row.clock_offset_s,
    )


def _token(row: orm.EnrollmentTokenRow) -> EnrollmentTokenRecord:
    return EnrollmentTokenRecord(
        id=row.id,
        name=row.name,
        attributes=dict(row.attributes),
        expires_at=aware(row.expires_at),
        uses_left=row.uses_left,
        created_by=row.created_by,
        created_at=aware(row.created_at),
    )


class SqlFleetStore(FleetStore):
    """The fleet half of `SqlStore`; needs `_scope()` and `_read()` from it."""

    def add_enrollment_token(self, record: EnrollmentTokenRecord, token_sha256: str) -> None:
        """Store an enrollment token's hash and terms."""
        with self._scope() as session:
            session.add(
                orm.EnrollmentTokenRow(
                    id=record.id,
                    name=record.name,
                    token_sha256=token_sha256,
                    attributes=record.attributes,
                    expires_at=record.expires_at,
                    uses_left=record.uses_left,
                    created_by=record.created_by,
                    created_at=record.created_at,
                )
            )

    def enroll_device(
        self, *, token_sha256: str, now: dt.datetime, make_device: EnrollFunc
    ) -> DeviceRecord:
        """Spend one use of the token and insert the device, in one transaction."""
        with self._scope() as session:
            row = session.scalar(
                select(orm.EnrollmentTokenRow)
                .where(orm.EnrollmentTokenRow.token_sha256 == token_sha256)
                .with_for_update()
            )
            if row is None:
                raise errors.UnknownCredential("invalid enrollment token")
            if aware(row.expires_at) <= now:
                raise errors.Unauthenticated(f"enrollment token {row.id} has expired")
            if row.uses_left is not None and row.uses_left <= 0:
                raise errors.Unauthenticated(f"enrollment token {row.id} is used up")
            if row.uses_left is not None:
                row.uses_left -= 1
            row.uses += 1
            device, credential_sha256, keyset = make_device(_token(row))
            session.add(
                orm.DeviceRow(
                    id=device.id,
                    credential_sha256=credential_sha256,
                    public_keyset=keyset,
                    attributes=device.attributes,
                    stamped_attributes=dict(row.attributes),
                    enrollment_token_id=row.id,
                    enrolled_at=device.enrolled_at,
                    last_seen=device.enrolled_at,
                    revoked_reason="",
                )
            )
            return device

    def find_device(self, credential_sha256: str) -> DeviceAuth | None:
        """Look a device up by the hash of its credential (core select: every call's path)."""
        with self._read_connection() as conn:
            found = conn.execute(_FIND_DEVICE, {"digest": credential_sha256}).first()
        if found is None:
            return None
        device_id, keyset, revoked_at, stamped = found
        return DeviceAuth(device_id, keyset, revoked_at is not None, dict(stamped))

    def get_device(self, device_id: str) -> DeviceRecord:
        """Return one device."""
        with self._read() as session:
            row = session.get(orm.DeviceRow, device_id)
            if row is None:
                raise errors.NotFound(f"device {device_id!r} not found")
            models = session.scalars(
                select(orm.DeviceModelRow).where(orm.DeviceModelRow.device_id == device_id)
            ).all()
            return _device(row, models)

    def list_devices(self, *, after: str = "", limit: int | None = None) -> list[DeviceRecord]:
        """Return devices by id: those after `after`, at most `limit` (None: every one)."""
        stmt = (
            select(orm.DeviceRow)
            .where(orm.DeviceRow.id > after)
            .order_by(orm.DeviceRow.id)
            .limit(limit)
        )
        with self._read() as session:
            rows = session.scalars(stmt).all()
            models = select(orm.DeviceModelRow)
            if limit is not None:
                models = models.where(orm.DeviceModelRow.device_id.in_([r.id for r in rows]))
            by_device: dict[str, list[orm.DeviceModelRow]] = {}
            for m in session.scalars(models):
                by_device.setdefault(m.device_id, []).append(m)
            return [_device(r, by_device.get(r.id, ())) for r in rows]

    def watch_states(self, device_ids: Sequence[str]) -> dict[str, WatchState]:
        """Return each named device's WatchState: two core selects per 500 devices.

        Outside a transaction, as `find_device`: each statement reads what was committed
        when it runs, so a revocation committed before the call is seen. The ORM session
        of `get_device` cost ~1 ms a call, whatever the number of devices.
        """
        out: dict[str, WatchState] = {}
        with self._read_connection() as conn:
            for start in range(0, len(device_ids), 500):
                ids = list(device_ids[start : start + 500])
                synced: dict[str, list[ModelState]] = {}
                for device_id, model, version, variant in conn.execute(_SYNCED_OF, {"ids": ids}):
                    synced.setdefault(device_id, []).append(
                        ModelState(model, version, variant or "")
                    )
                for device_id, attributes, revoked_at in conn.execute(_WATCHED, {"ids": ids}):
                    states = sorted(synced.get(device_id, ()), key=lambda m: m.model)
                    out[device_id] = WatchState(
                        dict(attributes), revoked_at is not None, tuple(states)
                    )
        return out

    def device_attributes(self, device_ids: Sequence[str]) -> dict[str, dict]:
        """Return the stored attributes of the given non-revoked devices."""
        out: dict[str, dict] = {}
        with self._read() as session:
            for start in range(0, len(device_ids), 500):
                stmt = select(orm.DeviceRow.id, orm.DeviceRow.attributes).where(
                    orm.DeviceRow.id.in_(device_ids[start : start + 500]),
                    orm.DeviceRow.revoked_at.is_(None),
                )
                out.update({i: dict(a) for i, a in session.execute(stmt)})
        return out

    def live_device_attributes(self) -> list[tuple[str, dict]]:
        """Return (id, attributes) of every device that is not revoked.

        Read as the stored JSON text through a plain connection and parsed here: a
        rollout's counts read the whole fleet on every `rollout show` and promote, and 20k
        devices read through the ORM's row processing held a server worker 0.14 s.
        """
        with self._read_connection() as conn:
            rows = conn.execute(_LIVE_ATTRIBUTES).all()
        return [(i, json.loads(a)) for i, a in rows]

    def revoke_device(self, device_id: str, *, at: dt.datetime, reason: str) -> DeviceRecord:
        """Mark a device revoked and bump the revision."""
        with self._scope() as session:
            row = session.get(orm.DeviceRow, device_id, with_for_update=True)
            if row is None:
                raise errors.NotFound(f"device {device_id!r} not found")
            if row.revoked_at is None:
                row.revoked_at, row.revoked_reason, row.online_until = at, reason, None
                bump_revision(session, "device", device_id)
            session.flush()
            return _device(row, ())

    def apply_device_updates(self, updates: Sequence[DeviceUpdate]) -> None:
        """Write a batch of device updates in one transaction, a few statements per batch.

        Set-based on purpose: a Sync storm flushes thousands of devices at once, and one
        ORM statement per device and model cost ~0.5 ms of Python each (the bench's
        profile), more than the Sync itself. Every statement and its rows are built
        before the transaction opens: it holds its row locks only while statements run,
        not while this thread waits for the GIL to build them.
        """
        if not updates:
            return
        attributed = [u for u in updates if u.attributes is not None]
        statements: list[tuple] = [
            (_SEEN_WITH_ATTRIBUTES, [(u.last_seen, u.attributes, u.device_id) for u in attributed]),
            (_SEEN, [(u.last_seen, u.device_id) for u in updates if u.attributes is None]),
        ]
        for kind in ("installed", "synced"):
            statements += _state_statements(self.dialect, updates, kind)
        with self._scope() as session:
            conn = session.connection()
            _lock_devices(conn, [u.device_id for u in updates])
            for stmt, params in statements:
                if isinstance(stmt, Bulk):
                    stmt.run(session, params)  # many rows straight to the driver
                else:
                    conn.execute(stmt, params)

    def set_online(self, device_ids: Sequence[str], until: dt.datetime | None) -> None:
        """Mark devices' Watch streams open until `until` (None: closed)."""
        with self._scope() as session:
            _lock_devices(session.connection(), device_ids)
            for start in range(0, len(device_ids), 500):
                session.execute(
                    update(orm.DeviceRow)
                    .where(orm.DeviceRow.id.in_(device_ids[start : start + 500]))
                    .values(online_until=until)
                )

    def count_model_states(self, model: str, version: int, variant: str) -> tuple[int, int, int]:
        """Return (synced, installed, failed) live-device counts for one version and variant."""
        m, d = orm.DeviceModelRow, orm.DeviceRow
        live = select(func.count()).select_from(m).join(d).where(d.revoked_at.is_(None))
        counts = []
        with self._read() as session:
            for kind in ("synced", "installed", "failed"):
                version_col, variant_col = (
                    getattr(m, f"{kind}_version"),
                    getattr(m, f"{kind}_variant"),
                )
                counts.append(
                    session.scalar(
                        live.where(m.model == model, version_col == version, variant_col == variant)
                    )
                    or 0
                )
        return counts[0], counts[1], counts[2]

    def revision(self) -> int:
        """Return the current fleet revision."""
        with self._read() as session:
            return session.scalar(select(orm.FleetStateRow.revision)) or 0


def _state_statements(dialect: str, updates: Sequence[DeviceUpdate], kind: str) -> list[tuple]:
    """Return (statement, parameters) replacing one kind of model state of the updates.

    One kind is installed or synced. Only what changed is written: a device that reports
    what it reported before rewrites no row (PostgreSQL makes no new tuple, no index
    entry, no WAL); a model it no longer reports is cleared, one it reports differently
    is set and stamped.
    """
    table = orm.DeviceModelRow.__table__
    named = [u for u in updates if getattr(u, kind) is not None]
    version, variant = f"{kind}_version", f"{kind}_variant"
    statements: list[tuple] = []
    for batch in _by_parameters(named, kind) if named else ():
        kept = [(u.device_id, s.model) for u in batch for s in getattr(u, kind)]
        clear = table.c.device_id.in_([u.device_id for u in batch]) & table.c[version].is_not(None)
        if kept:
            clear &= tuple_(table.c.device_id, table.c.model).not_in(kept)
        statements.append((update(table).where(clear).values({version: None, variant: None}), {}))
    rows = [
        (u.device_id, s.model, s.version, s.variant, u.last_seen, "")
        for u in named
        for s in getattr(u, kind)
    ]
    if rows:
        statements.append((_STATE_UPSERTS[dialect, kind], rows))
    return statements


def _state_upsert(dialect: str, kind: str) -> Bulk:
    """Set one kind of model state of (device, model), unless it is what is stored."""
    table = orm.DeviceModelRow.__table__
    version, variant = f"{kind}_version", f"{kind}_variant"
    stamp = "reported_at" if kind == "installed" else "synced_at"
    # failed_reason: its default, given (a new row's; the driver alone knows no defaults).
    columns = ("device_id", "model", version, variant, stamp, "failed_reason")
    insert = (postgresql if dialect == "postgresql" else sqlite).insert(table).inline()
    insert = insert.values({c: bindparam(c) for c in columns})
    upsert = insert.on_conflict_do_update(
        index_elements=["device_id", "model"],
        set_={c: insert.excluded[c] for c in (version, variant, stamp)},
        where=table.c[version].is_distinct_from(insert.excluded[version])
        | table.c[variant].is_distinct_from(insert.excluded[variant]),
    )
    return Bulk(upsert, columns)


_STATE_UPSERTS = {
    (dialect, kind): _state_upsert(dialect, kind)
    for dialect in ("sqlite", "postgresql")
    for kind in ("installed", "synced")
}
_SEEN = Bulk.update(orm.DeviceRow.__table__, ("last_seen",), ("id",))
_SEEN_WITH_ATTRIBUTES = Bulk.update(orm.DeviceRow.__table__, ("last_seen", "attributes"), ("id",))


# Bound parameters per statement that clears states: SQLite's limit is 32,766.
_STATEMENT_PARAMETERS = 1000


def _by_parameters(updates: Sequence[DeviceUpdate], kind: str) -> list[list[DeviceUpdate]]:
    """Split updates into batches whose clearing statement stays under the limit."""
    batches: list[list[DeviceUpdate]] = [[]]
    used = 0
    for u in updates:
        cost = 1 + 2 * len(getattr(u, kind))
        if batches[-1] and used + cost > _STATEMENT_PARAMETERS:
            batches.append([])
            used = 0
        batches[-1].append(u)
        used += cost
    return batches


def _lock_devices(conn, device_ids: Sequence[str]) -> None:
    """Lock device rows in id order, before a transaction updates several (PostgreSQL).

    Two transactions that update overlapping devices each lock rows in the order their
    statements reach them: the write-behind flush in its batch's order, a replica marking
    its Watch streams closed in the order PostgreSQL scans an IN list. Opposite orders
    deadlocked (seen as a replica's stop failing on DeadlockDetected). Locking every row
    first, sorted, gives every such transaction the same order. SQLite locks the whole
    database per write: nothing to order.
    """
    if conn.dialect.name != "postgresql" or not device_ids:
        return
    devices = orm.DeviceRow.__table__
    ordered = sorted(set(device_ids))
    for start in range(0, len(ordered), 500):
        conn.execute(
            select(devices.c.id)
            .where(devices.c.id.in_(ordered[start : start + 500]))
            .order_by(devices.c.id)
            .with_for_update()
        )
