"""SQLAlchemy implementation of the registry store: SQLite (WAL) and PostgreSQL."""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence

from sqlalchemy import create_engine, event, func, select, text, update
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import Session, selectinload, sessionmaker

from control_plane import errors
from control_plane.crypto.kek import WrappedKey
from control_plane.store import orm
from control_plane.store.base import (
    KekState,
    ModelRecord,
    RegistryStore,
    StaleKek,
    StoredDataKey,
    VariantRecord,
    VersionBuilder,
    VersionRecord,
)
from control_plane.store.fleet import Change
from control_plane.store.migrate import upgrade
from control_plane.store.sql_fleet import SqlFleetStore
from control_plane.store.sql_rollouts import SqlRolloutStore
from control_plane.store.sql_signing_keys import SqlSigningKeyStore
from control_plane.store.sql_tokens import SqlTokenStore

log = logging.getLogger(__name__)

# A concurrent push that takes the same number loses on the unique constraint and retries.
_VERSION_RETRIES = 5
# PostgreSQL advisory-lock key of KEK rotation (any constant unique to this use: "skiffkek").
_KEK_ROTATION_LOCK = 0x736B6966666B656B
_KEK_STATE_ID = 1
# SQLite databases without a file (in memory) live in one process: a thread lock will do.
_MEMORY_KEK_LOCK = threading.Lock()


def _sqlite_pragmas(dbapi_conn, _record) -> None:
    # WAL lets readers proceed during a push; busy_timeout makes writers queue instead of
    # failing at once; SQLite leaves foreign keys off unless asked. pysqlite's own BEGIN
    # is switched off so that _sqlite_begin decides how transactions start.
    dbapi_conn.isolation_level = None
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _sqlite_begin(conn) -> None:
    # A deferred transaction that reads (the next version number) and then writes loses
    # to any writer that committed in between, however long it waits. Taking the write
    # lock up front makes concurrent writers queue on busy_timeout instead.
    conn.exec_driver_sql("BEGIN IMMEDIATE")


def _sqlite_begin_read(conn) -> None:
    # Read-only transactions must not queue behind writers: in WAL mode a plain BEGIN
    # reads a consistent snapshot while a writer holds the lock.
    conn.exec_driver_sql("BEGIN")


def make_engine(url: str, *, read_only: bool = False) -> Engine:
    """Create an engine for a SQLAlchemy URL, with the settings each backend needs.

    On SQLite, `read_only` makes an engine whose transactions do not take the write lock.
    """
    try:
        return _make_engine(url, read_only=read_only)
    except (sa_exc.ArgumentError, ValueError) as exc:
        # The reason names the bad part (e.g. a port that is not a number), never the URL.
        raise errors.InvalidArgument(f"invalid database URL: {exc}") from None


def _make_engine(url: str, *, read_only: bool) -> Engine:
    if url.startswith("sqlite"):
        # hide_parameters: a logged database error never carries the values it was given.
        engine = create_engine(url, connect_args={"timeout": 10}, hide_parameters=True)
        event.listen(engine, "connect", _sqlite_pragmas)
        event.listen(engine, "begin", _sqlite_begin_read if read_only else _sqlite_begin)
        return engine
    if url.startswith("postgresql"):
        # pool_pre_ping turns a server restart into one reconnect instead of an error;
        # connect_timeout bounds how long a call waits on an unreachable server.
        return create_engine(
            url, pool_pre_ping=True, connect_args={"connect_timeout": 5}, hide_parameters=True
        )
    raise errors.InvalidArgument(f"unsupported database URL scheme: {url.split(':', 1)[0]}")


def _sorted_db_error(exc: sa_exc.SQLAlchemyError) -> errors.SkiffError:
    """Sort a database error once: lost connection is retryable, integrity is a conflict."""
    if isinstance(exc, sa_exc.IntegrityError):
        return errors.AlreadyExists("already exists (constraint violated)")
    if isinstance(exc, sa_exc.DataError):
        # A value the database refuses (NUL in text, too long, out of range) got past
        # validation: the caller's fault, but worth a line so the gap gets closed.
        log.warning("database refused a value: %s", type(exc.orig or exc).__name__)
        return errors.InvalidArgument("a value was refused by the database (malformed or too long)")
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError):
        return errors.Unavailable("database unavailable: " + type(exc.orig or exc).__name__)
    log.error("unexpected database error: %s", exc)
    return errors.SkiffError("database error: " + type(exc).__name__)


def _variant(row: orm.VariantRow) -> VariantRecord:
    return VariantRecord(
        name=row.name,
        plaintext_size=row.plaintext_size,
        plaintext_sha256=row.plaintext_sha256,
        ciphertext_size=row.ciphertext_size,
        ciphertext_sha256=row.ciphertext_sha256,
        segment_size=row.segment_size,
        signature=dict(row.signature),
    )


def _aware(value: dt.datetime) -> dt.datetime:
    # SQLite hands back naive datetimes; everything Skiff stores is UTC.
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def _version(row: orm.VersionRow, model: str) -> VersionRecord:
    return VersionRecord(
        model=model,
        number=row.number,
        created_at=_aware(row.created_at),
        uid=row.uid,
        created_by=row.created_by,
        notes=row.notes,
        source_format=row.source_format,
        signature=dict(row.signature),
        variants=tuple(_variant(v) for v in row.variants),
        data_key=WrappedKey(kek_id=row.kek_id, ciphertext=row.wrapped_data_key),
        manifest=row.manifest,
        manifest_signature=row.manifest_signature,
        signing_key_id=row.signing_key_id,
    )


def _kek_state(row: orm.KekStateRow) -> KekState:
    return KekState(row.active_kek_id, row.active_url, tuple(row.keyring))


class SqlStore(SqlFleetStore, SqlRolloutStore, SqlTokenStore, SqlSigningKeyStore, RegistryStore):
    """Registry, fleet, rollout, token and signing-key store over any SQLAlchemy URL."""

    def __init__(self, url: str, *, migrate: bool = True) -> None:
        self.url = url
        self._engine = make_engine(url)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        # SQLite: a second pool whose transactions are plain (deferred) BEGINs, for calls
        # that only read; PostgreSQL needs no such split.
        self._reader = make_engine(url, read_only=True) if url.startswith("sqlite") else None
        self._read_sessions = (
            sessionmaker(self._reader, expire_on_commit=False) if self._reader else self._sessions
        )
        self._listeners: list[Callable[[Change], None]] = []
        if migrate:
            self.check()  # sorts "cannot connect" into Unavailable before Alembic runs
            upgrade(self._engine)

    @property
    def dialect(self) -> str:
        """Return the database's dialect name ("sqlite" or "postgresql")."""
        return self._engine.dialect.name

    def add_change_listener(self, listener: Callable[[Change], None]) -> None:
        """Call `listener` after every commit that bumped the fleet revision (this process)."""
        self._listeners.append(listener)

    @contextlib.contextmanager
    def _read_connection(self) -> Iterator[Connection]:
        """Open a read-only connection without an ORM session (for the hottest lookups)."""
        try:
            with (self._reader or self._engine).connect() as conn:
                yield conn
        except sa_exc.SQLAlchemyError as exc:
            raise _sorted_db_error(exc) from exc

    @contextlib.contextmanager
    def _read(self) -> Iterator[Session]:
        """Open a read-only transaction (never queues behind a writer on SQLite)."""
        try:
            with self._read_sessions.begin() as session:
                yield session
        except sa_exc.SQLAlchemyError as exc:
            raise _sorted_db_error(exc) from exc

    @contextlib.contextmanager
    def _scope(self) -> Iterator[Session]:
        """One transaction per call; database errors are sorted here and nowhere else."""
        try:
            with self._sessions.begin() as session:
                yield session
        except sa_exc.SQLAlchemyError as exc:
            raise _sorted_db_error(exc) from exc
        # Committed: tell this process's listeners (other replicas hear PostgreSQL NOTIFY).
        for revision, kind, subject in session.info.pop("changes", ()):
            for listener in self._listeners:
                listener(Change(revision, kind, subject))

    def create_version(self, model: str, build: VersionBuilder) -> VersionRecord:
        """Append the next version; retries when a concurrent push took the number."""
        for attempt in range(_VERSION_RETRIES):
            try:
                return self._insert_version(model, build)
            except errors.AlreadyExists:
                if attempt == _VERSION_RETRIES - 1:
                    raise
        raise AssertionError("unreachable")

    def _model_row(self, session: Session, name: str) -> orm.ModelRow:
        row = session.scalar(select(orm.ModelRow).where(orm.ModelRow.name == name))
        if row is None:
            row = orm.ModelRow(name=name)
            session.add(row)
            session.flush()
        return row

    def _insert_version(self, model: str, build: VersionBuilder) -> VersionRecord:
        with self._scope() as session:
            model_row = self._model_row(session, model)
            # Serialises pushes of one model on PostgreSQL; SQLite transactions already
            # hold the write lock (BEGIN IMMEDIATE).
            session.execute(
                select(orm.ModelRow.id).where(orm.ModelRow.id == model_row.id).with_for_update()
            )
            latest = session.scalar(
                select(func.max(orm.VersionRow.number)).where(
                    orm.VersionRow.model_id == model_row.id
                )
            )
            new = build((latest or 0) + 1)
            self._check_active_kek(session, new.data_key.kek_id)
            row = orm.VersionRow(
                model_id=model_row.id,
                number=(latest or 0) + 1,
                uid=new.uid,
                created_at=new.created_at,
                created_by=new.created_by,
                notes=new.notes,
                source_format=new.source_format,
                signature=new.signature,
                kek_id=new.data_key.kek_id,
                wrapped_data_key=new.data_key.ciphertext,
                manifest=new.manifest,
                manifest_signature=new.manifest_signature,
                signing_key_id=new.signing_key_id,
                variants=[orm.VariantRow(**v.__dict__) for v in new.variants],
            )
            session.add(row)
            session.flush()
            return _version(row, model)

    def _models_query(self):
        return (
            select(orm.ModelRow, func.max(orm.VersionRow.number), func.count(orm.VersionRow.id))
            .join(orm.VersionRow)
            .group_by(orm.ModelRow.id)
            .order_by(orm.ModelRow.name)
        )

    def list_models(self, *, after: str = "", limit: int | None = None) -> list[ModelRecord]:
        """Return models with versions by name: those after `after`, at most `limit`."""
        stmt = self._models_query().where(orm.ModelRow.name > after).limit(limit)
        with self._read() as session:
            return [
                ModelRecord(m.name, _aware(m.created_at), latest, count)
                for m, latest, count in session.execute(stmt)
            ]

    def get_model(self, name: str) -> ModelRecord:
        """Return one model."""
        stmt = self._models_query().where(orm.ModelRow.name == name)
        with self._read() as session:
            for m, latest, count in session.execute(stmt):
                return ModelRecord(m.name, _aware(m.created_at), latest, count)
        raise errors.NotFound(f"model {name!r} not found")

    def _versions_query(self, name: str):
        return (
            select(orm.VersionRow)
            .join(orm.ModelRow)
            .where(orm.ModelRow.name == name)
            .options(selectinload(orm.VersionRow.variants))
            .order_by(orm.VersionRow.number)
        )

    def list_versions(
        self, name: str, *, after: int = 0, limit: int | None = None
    ) -> list[VersionRecord]:
        """Return a model's versions oldest first: those after number `after`, at most `limit`."""
        stmt = self._versions_query(name).where(orm.VersionRow.number > after).limit(limit)
        with self._read() as session:
            rows = session.scalars(stmt).all()
            if not rows and not session.scalar(
                select(orm.ModelRow.id).where(orm.ModelRow.name == name)
            ):
                raise errors.NotFound(f"model {name!r} not found")
            return [_version(r, name) for r in rows]

    def get_version(self, name: str, number: int | None = None) -> VersionRecord:
        """Return one version, the latest when number is None."""
        stmt = self._versions_query(name)
        if number is None:
            stmt = stmt.order_by(None).order_by(orm.VersionRow.number.desc()).limit(1)
        else:
            stmt = stmt.where(orm.VersionRow.number == number)
        with self._read() as session:
            row = session.scalars(stmt).first()
            if row is None:
                what = f"model {name!r}" if number is None else f"version {name}:{number}"
                raise errors.NotFound(f"{what} not found")
            return _version(row, name)

    def referenced_blobs(self) -> set[str]:
        """Return every ciphertext digest a variant points at."""
        with self._read() as session:
            return set(session.scalars(select(orm.VariantRow.ciphertext_sha256)))

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
            )
            .where(orm.VersionRow.kek_id != kek_id, orm.VersionRow.id > after)
            .order_by(orm.VersionRow.id)
            .limit(limit)
        )
        with self._read() as session:
            return [
                StoredDataKey(row_id, uid, WrappedKey(old_id, wrapped))
                for row_id, uid, old_id, wrapped in session.execute(stmt)
            ]

    def replace_data_keys(self, moves: Sequence[tuple[StoredDataKey, WrappedKey]]) -> int:
        """Store re-wrapped data keys in one short transaction."""
        changed = 0
        with self._scope() as session:
            for stored, new in moves:
                result = session.execute(
                    update(orm.VersionRow)
                    .where(
                        orm.VersionRow.id == stored.row_id,
                        orm.VersionRow.kek_id == stored.data_key.kek_id,
                        orm.VersionRow.wrapped_data_key == stored.data_key.ciphertext,
                    )
                    .values(kek_id=new.kek_id, wrapped_data_key=new.ciphertext)
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
            raise _sorted_db_error(exc) from exc
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
            raise _sorted_db_error(exc) from exc
        finally:
            conn.close()

    def has_schema(self) -> bool:
        """Return whether the database holds Skiff's tables (for tools run without migrating)."""
        try:
            return sa_inspect(self._engine).has_table("api_tokens")
        except sa_exc.SQLAlchemyError as exc:
            raise _sorted_db_error(exc) from exc

    def check(self) -> None:
        """Probe the database."""
        with self._read() as session:
            session.execute(text("SELECT 1"))

    def close(self) -> None:
        """Dispose of the connection pools."""
        self._engine.dispose()
        if self._reader is not None:
            self._reader.dispose()
