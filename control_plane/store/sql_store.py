"""SQLAlchemy implementation of the registry store: SQLite (WAL) and PostgreSQL."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy import exc as sa_exc
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection, Engine, make_url
from sqlalchemy.orm import Session, selectinload, sessionmaker

from contract import errors
from control_plane.store import orm
from control_plane.store.base import (
    ModelRecord,
    RegistryStore,
    StaleKek,
    VariantRecord,
    VersionBuilder,
    VersionRecord,
    WrappedKey,
    chunk_blobs,
)
from control_plane.store.fleet import Change
from control_plane.store.migrate import upgrade
from control_plane.store.sql_errors import sorted_db_error as _sorted_db_error
from control_plane.store.sql_fleet import SqlFleetStore, aware
from control_plane.store.sql_keks import SqlKekStore
from control_plane.store.sql_rollouts import SqlRolloutStore
from control_plane.store.sql_rollups import SqlRollupStore
from control_plane.store.sql_sessions import SqlWebSessionStore
from control_plane.store.sql_signing_key_records import SqlSigningKeyStore
from control_plane.store.sql_telemetry import SqlTelemetryStore
from control_plane.store.sql_tokens import SqlTokenStore

# A concurrent push that takes the same number loses on the unique constraint and retries.
_VERSION_RETRIES = 5
# Connections a pool keeps open: the process's handler threads (the RPC pool and the
# event loop's executor) plus the writers and timers. SQLAlchemy's default (5, closing
# every overflow connection on return) made PostgreSQL open hundreds of sessions a
# second under a Sync storm (FACTS.md), and SQLite reopen its file and pragmas each
# time; overflow beyond this is for rare peaks.
POOL_SIZE = 24
_AUTOCOMMIT = "AUTOCOMMIT"
# libpq's settings for a PostgreSQL connection, where the URL does not set them: a server
# that vanishes mid-query (a failover, a cut network) fails the query within about 30 s
# instead of at the kernel's TCP timeout (minutes to hours). A read that hung would hold
# everything queued behind it: every Watch that opens on a replica shares one read
# (control_plane.api.coalesce). connect_timeout bounds the wait on an unreachable server.
PG_CONNECT = {
    "connect_timeout": 5,
    "keepalives": 1,  # an idle connection (waiting for a slow query's answer) is probed
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
    "tcp_user_timeout": 30_000,  # ms a sent query may wait for the server's TCP ack
}


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


def make_engine(
    url: str, *, read_only: bool = False, autocommit: bool = False, pool_size: int = 0
) -> Engine:
    """Create an engine for a SQLAlchemy URL, with the settings each backend needs.

    On SQLite, `read_only` makes an engine whose transactions do not take the write lock,
    and `autocommit` one whose statements run without a transaction of their own.
    `pool_size`: connections the pool keeps (0: POOL_SIZE), a third more at peaks.
    """
    pool = {"pool_size": pool_size or POOL_SIZE, "max_overflow": (pool_size or POOL_SIZE) // 3}
    try:
        return _make_engine(url, read_only=read_only, autocommit=autocommit, pool=pool)
    except (sa_exc.ArgumentError, ValueError) as exc:
        # The reason names the bad part (e.g. a port that is not a number), never the URL.
        raise errors.InvalidArgument(f"invalid database URL: {exc}") from None


def _make_engine(url: str, *, read_only: bool, autocommit: bool, pool: dict) -> Engine:
    if url.startswith("sqlite"):
        # hide_parameters: a logged database error never carries the values it was given.
        engine = create_engine(
            url,
            connect_args={"timeout": 10},
            hide_parameters=True,
            **pool,
            **({"isolation_level": _AUTOCOMMIT} if autocommit else {}),
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        if not autocommit:
            event.listen(engine, "begin", _sqlite_begin_read if read_only else _sqlite_begin)
        return engine
    if url.startswith("postgresql"):
        # pool_pre_ping turns a server restart into one reconnect instead of an error.
        given = make_url(url).query
        return create_engine(
            url,
            pool_pre_ping=True,
            **pool,
            connect_args={k: v for k, v in PG_CONNECT.items() if k not in given},
            hide_parameters=True,
        )
    raise errors.InvalidArgument(f"unsupported database URL scheme: {url.split(':', 1)[0]}")


def _variant(row: orm.VariantRow) -> VariantRecord:
    return VariantRecord(
        name=row.name,
        plaintext_size=row.plaintext_size,
        plaintext_sha256=row.plaintext_sha256,
        ciphertext_size=row.ciphertext_size,
        ciphertext_sha256=row.ciphertext_sha256,
        segment_size=row.segment_size,
        signature=dict(row.signature),
        accuracy=dict(row.accuracy or {}),
        degraded=bool(row.degraded),
        chunks=dict(row.chunks or {}),
    )


def _version(row: orm.VersionRow, model: str) -> VersionRecord:
    return VersionRecord(
        model=model,
        number=row.number,
        created_at=aware(row.created_at),
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
        golden=dict(row.golden or {}),
        chunk_secret=WrappedKey(kek_id=row.kek_id, ciphertext=row.wrapped_chunk_secret)
        if row.wrapped_chunk_secret
        else None,
    )


class SqlStore(
    SqlFleetStore,
    SqlRolloutStore,
    SqlTelemetryStore,
    SqlRollupStore,
    SqlTokenStore,
    SqlWebSessionStore,
    SqlSigningKeyStore,
    SqlKekStore,
    RegistryStore,
):
    """Registry, fleet, rollout, telemetry, token, session and signing-key store (any SQL URL)."""

    def __init__(self, url: str, *, migrate: bool = True, pool_size: int = 0) -> None:
        self.url = url
        self._engine = make_engine(url, pool_size=pool_size)
        self._sessions = sessionmaker(self._engine, expire_on_commit=False)
        # SQLite: a second pool whose transactions are plain (deferred) BEGINs, for calls
        # that only read; PostgreSQL needs no such split.
        self._reader = (
            make_engine(url, read_only=True, pool_size=pool_size)
            if url.startswith("sqlite")
            else None
        )
        self._read_sessions = (
            sessionmaker(self._reader, expire_on_commit=False) if self._reader else self._sessions
        )
        # One-statement reads (the credential lookup of every call) run outside any
        # transaction: no BEGIN and ROLLBACK round trips, never idle in transaction. On
        # SQLite a pool of their own (switching a pooled connection's isolation level
        # each time cost more than the query); PostgreSQL's driver switches for free.
        self._single_reads = (
            make_engine(url, read_only=True, autocommit=True, pool_size=pool_size)
            if url.startswith("sqlite")
            else self._engine.execution_options(isolation_level=_AUTOCOMMIT)
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
        """Open a connection for ONE read statement, outside any transaction (hot lookups)."""
        try:
            with self._single_reads.connect() as conn:
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
            if new.chunk_secret is not None and new.chunk_secret.kek_id != new.data_key.kek_id:
                raise StaleKek("the chunk secret and the data key are under different KEKs")
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
                wrapped_chunk_secret=new.chunk_secret.ciphertext if new.chunk_secret else None,
                manifest=new.manifest,
                manifest_signature=new.manifest_signature,
                signing_key_id=new.signing_key_id,
                golden=new.golden,
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
                ModelRecord(m.name, aware(m.created_at), latest, count)
                for m, latest, count in session.execute(stmt)
            ]

    def get_model(self, name: str) -> ModelRecord:
        """Return one model."""
        stmt = self._models_query().where(orm.ModelRow.name == name)
        with self._read() as session:
            for m, latest, count in session.execute(stmt):
                return ModelRecord(m.name, aware(m.created_at), latest, count)
        raise errors.NotFound(f"model {name!r} not found")

    def _versions_query(self, name: str):
        return (
            select(orm.VersionRow)
            .join(orm.ModelRow)
            .where(orm.ModelRow.name == name)
            .options(selectinload(orm.VersionRow.variants))
            .order_by(orm.VersionRow.number)
        )

    def published_variants(self) -> frozenset[tuple[str, int, str]]:
        """Return every (model, version number, variant) published, in one read."""
        m, v, x = orm.ModelRow, orm.VersionRow, orm.VariantRow
        with self._read() as session:
            rows = session.execute(
                select(m.name, v.number, x.name)
                .join(v, v.model_id == m.id)
                .join(x, x.version_id == v.id)
            ).all()
        return frozenset((name, number, variant) for name, number, variant in rows)

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
        """Return every blob a variant (whole, or its chunks and key list) or golden data names."""
        with self._read() as session:
            found = set(session.scalars(select(orm.VariantRow.ciphertext_sha256)))
            for stored in session.scalars(
                select(orm.VariantRow.chunks).where(orm.VariantRow.chunks.is_not(None))
            ):
                found |= chunk_blobs(stored)
            for golden in session.scalars(select(orm.VersionRow.golden)):
                if golden and golden.get("ciphertext_sha256"):
                    found.add(golden["ciphertext_sha256"])
            return found

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
        self._single_reads.dispose()
        if self._reader is not None:
            self._reader.dispose()
