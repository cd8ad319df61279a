"""KEK state on SQL: which KEK is active, its keyring, and the rotation lock (a mixin).

Split from sql_store.py; it needs `_scope()`, `_read()`, `_engine`, `dialect` and `url`
from SqlStore.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator, Sequence

from sqlalchemy import exc as sa_exc
from sqlalchemy import func, select, text, update
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session

from contract import errors
from control_plane.store import orm
from control_plane.store.base import (
    KekState,
    StaleKek,
    StoredDataKey,
    WrappedKey,
)
from control_plane.store.sql_errors import sorted_db_error

# PostgreSQL advisory-lock key of KEK rotation (any constant unique to this use: "skiffkek").
_KEK_ROTATION_LOCK = 0x736B6966666B656B
_KEK_STATE_ID = 1
# SQLite databases without a file (in memory) live in one process: a thread lock will do.
_MEMORY_KEK_LOCK = threading.Lock()


def _kek_state(row: orm.KekStateRow) -> KekState:
    return KekState(row.active_kek_id, row.active_url, tuple(row.keyring))


class SqlKekStore:
    """The KEK half of SqlStore."""

    @staticmethod
    def _check_active_kek(session: Session, kek_id: str) -> None:
        # FOR SHARE: a rotation switching the active KEK (FOR UPDATE) waits for this
        # insert to commit, or this read waits for the switch and sees the new KEK.
        active = session.scalar(
            select(orm.KekStateRow.active_kek_id)
            .where(orm.KekStateRow.id == _KEK_STATE_ID)
            .with_for_update(read=True)
        )
        if active is not None and active != kek_id:
            raise StaleKek(f"data key wrapped under {kek_id}, but the active KEK is {active}")

    def kek_state(self) -> KekState | None:
        """Return the shared KEK state; None before any server recorded one."""
        with self._read() as session:
            row = session.get(orm.KekStateRow, _KEK_STATE_ID)
            return None if row is None else _kek_state(row)

    def init_kek_state(self, state: KekState) -> KekState:
        """Record `state` unless one exists (the first replica to start wins)."""
        try:
            with self._scope() as session:
                if session.get(orm.KekStateRow, _KEK_STATE_ID) is None:
                    session.add(
                        orm.KekStateRow(
                            id=_KEK_STATE_ID,
                            active_kek_id=state.active_kek_id,
                            active_url=state.active_url,
                            keyring=list(state.keyring),
                        )
                    )
        except errors.AlreadyExists:
            pass  # another replica recorded it first
        current = self.kek_state()
        assert current is not None
        return current

    def add_to_keyring(self, url: str) -> KekState:
        """Add a KEK URL to the keyring."""
        with self._scope() as session:
            row = self._locked_kek_state(session)
            if url != row.active_url and url not in row.keyring:
                row.keyring = [*row.keyring, url]
            return _kek_state(row)

    def data_keys_not_under(self, kek_id: str, *, after: int, limit: int) -> list[StoredDataKey]:
        """Return up to `limit` data keys not wrapped under `kek_id`, by row id."""
        stmt = (
            select(
                orm.VersionRow.id,
                orm.VersionRow.uid,
                orm.VersionRow.kek_id,
                orm.VersionRow.wrapped_data_key,
                orm.VersionRow.wrapped_chunk_secret,
            )
            .where(orm.VersionRow.kek_id != kek_id, orm.VersionRow.id > after)
            .order_by(orm.VersionRow.id)
            .limit(limit)
        )
        with self._read() as session:
            return [
                StoredDataKey(
                    row_id,
                    uid,
                    WrappedKey(old_id, wrapped),
                    WrappedKey(old_id, secret) if secret else None,
                )
                for row_id, uid, old_id, wrapped, secret in session.execute(stmt)
            ]

    def replace_data_keys(
        self, moves: Sequence[tuple[StoredDataKey, WrappedKey, WrappedKey | None]]
    ) -> int:
        """Store re-wrapped data keys (and chunk secrets) in one short transaction."""
        changed = 0
        with self._scope() as session:
            for stored, new, secret in moves:
                if (secret is None) != (stored.chunk_secret is None) or (
                    secret is not None and secret.kek_id != new.kek_id
                ):
                    raise errors.FailedPrecondition(
                        f"version {stored.uid}: its chunk secret must move with its data key"
                    )
                result = session.execute(
                    update(orm.VersionRow)
                    .where(
                        orm.VersionRow.id == stored.row_id,
                        orm.VersionRow.kek_id == stored.data_key.kek_id,
                        orm.VersionRow.wrapped_data_key == stored.data_key.ciphertext,
                    )
                    .values(
                        kek_id=new.kek_id,
                        wrapped_data_key=new.ciphertext,
                        wrapped_chunk_secret=secret.ciphertext if secret else None,
                    )
                )
                changed += result.rowcount
        return changed

    def activate_kek(self, kek_id: str, url: str) -> int:
        """Make `kek_id` active if every data key is wrapped under it; else count the rest."""
        with self._scope() as session:
            row = self._locked_kek_state(session)
            # Counted after taking the lock: a push that read the old KEK has committed.
            left = session.scalar(select(func.count()).where(orm.VersionRow.kek_id != kek_id))
            if left:
                return left
            if row.active_kek_id != kek_id:
                keyring = [u for u in (*row.keyring, row.active_url) if u != url]
                row.keyring = list(dict.fromkeys(keyring))
                row.active_kek_id, row.active_url = kek_id, url
            return 0

    def _locked_kek_state(self, session: Session) -> orm.KekStateRow:
        row = session.scalar(
            select(orm.KekStateRow).where(orm.KekStateRow.id == _KEK_STATE_ID).with_for_update()
        )
        if row is None:
            raise errors.FailedPrecondition("no KEK state recorded yet (start a server first)")
        return row

    @contextlib.contextmanager
    def kek_rotation_lock(self) -> Iterator[None]:
        """Hold this database's KEK-rotation lock: advisory on PostgreSQL, a file lock on SQLite."""
        busy = errors.FailedPrecondition("another KEK rotation is running; try again when it ends")
        if self.dialect == "postgresql":
            with self._pg_rotation_lock(busy):
                yield
            return
        database = make_url(self.url).database
        if not database or database == ":memory:":
            if not _MEMORY_KEK_LOCK.acquire(blocking=False):
                raise busy
            try:
                yield
            finally:
                _MEMORY_KEK_LOCK.release()
            return
        # SQLite lives on one host; flock dies with the process that held it.
        fd = os.open(f"{database}.kek-rotation.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise busy from None
            yield
        finally:
            os.close(fd)  # releases the lock

    @contextlib.contextmanager
    def _pg_rotation_lock(self, busy: errors.SkiffError) -> Iterator[None]:
        # A session-level advisory lock on a connection of its own, outside any
        # transaction; the server drops it if this process dies.
        try:
            conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        except sa_exc.SQLAlchemyError as exc:
            raise sorted_db_error(exc) from exc
        try:
            locked = conn.scalar(
                text("SELECT pg_try_advisory_lock(:key)"), {"key": _KEK_ROTATION_LOCK}
            )
            if not locked:
                raise busy
            try:
                yield
            finally:
                conn.execute(text("SELECT pg_advisory_unlock(:key)"), {"key": _KEK_ROTATION_LOCK})
        except sa_exc.SQLAlchemyError as exc:
            raise sorted_db_error(exc) from exc
        finally:
            conn.close()
