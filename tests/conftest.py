"""Fixtures shared by the whole suite: real servers on loopback, port 0."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.ci import on_ci


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """An S3/KMS-compatible server speaking HTTP on loopback (moto's standalone server)."""
    from moto.server import ThreadedMotoServer

    # moto needs *some* credentials and a region; these are not secrets.
    for name, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        os.environ.setdefault(name, value)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{server._server.server_port}"
    finally:
        server.stop()


PG_ADMIN_URL = os.environ.get("SKIFF_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _pg_admin_engine():
    from sqlalchemy import create_engine

    return create_engine(
        PG_ADMIN_URL, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
    )


@contextlib.contextmanager
def fresh_pg_database(template: str | None = None) -> Iterator[str]:
    """Create an empty PostgreSQL database on the local server; drop it afterwards.

    With `template` (a database's URL, nobody connected to it), the new database is a copy
    of that one. On CI (CI set) an unreachable server fails the test: the PostgreSQL run
    is mandatory.
    """
    import uuid

    from sqlalchemy import exc, text

    admin = _pg_admin_engine()
    name = f"skiff_test_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            copy = "" if template is None else f' TEMPLATE "{template.rsplit("/", 1)[1]}"'
            conn.execute(text(f'CREATE DATABASE "{name}"{copy}'))
    except exc.OperationalError as error:
        admin.dispose()
        if on_ci():
            pytest.fail(f"PostgreSQL is required on CI and unreachable: {error}")
        pytest.skip(f"PostgreSQL unreachable: {error}")
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture
def pg_copy() -> Iterator[Callable[[str], str]]:
    """Return `copy(url)`: a new PostgreSQL database copied from `url`, dropped afterwards."""
    with contextlib.ExitStack() as stack:
        yield lambda url: stack.enter_context(fresh_pg_database(template=url))


@pytest.fixture(scope="module")
def module_pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database shared by one test module."""
    with fresh_pg_database() as url:
        yield url


@pytest.fixture(scope="session")
def sqlite_schema_template(tmp_path_factory) -> Path:
    """An SQLite database migrated to head, once per worker: `db_url` copies it.

    Migrating a new database from nothing costs ~0.3 s (Alembic replays every revision);
    hundreds of store tests each start from an empty schema at head, so they copy one.
    The migrations themselves are tested from nothing and back
    (tests/control_plane/store/test_store_conformance.py).
    """
    from control_plane.store.sql_store import SqlStore

    path = tmp_path_factory.mktemp("sqlite-template") / "skiff.db"
    SqlStore(f"sqlite:///{path}").close()
    assert not path.with_name("skiff.db-wal").exists()  # all of it is in the file
    return path


@pytest.fixture(scope="session")
def pg_schema_template() -> Iterator[str]:
    """A PostgreSQL database migrated to head, once per worker: `db_url` copies it."""
    from control_plane.store.sql_store import SqlStore

    with fresh_pg_database() as url:
        SqlStore(url).close()  # nobody stays connected: CREATE DATABASE ... TEMPLATE needs it
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path) -> Iterator[str]:
    """Every store test runs on SQLite and on PostgreSQL, on a new database at head."""
    if request.param == "sqlite":
        path = tmp_path / "skiff.db"
        shutil.copyfile(request.getfixturevalue("sqlite_schema_template"), path)
        yield f"sqlite:///{path}"
        return
    with fresh_pg_database(template=request.getfixturevalue("pg_schema_template")) as url:
        yield url


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    """Keep a module's tests on one xdist worker when they share a module-scoped fixture.

    `--dist loadgroup` hands ungrouped tests out one by one, so a module whose tests share
    an expensive module fixture (a control plane with a model pushed, a wheel built into
    a venv) would build it once on each worker. Tests already in a group keep theirs.
    """
    for item in items:
        if item.get_closest_marker("xdist_group") is not None:
            continue
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        scopes = {
            d.scope
            for defs in info.name2fixturedefs.values()
            for d in defs
            if d.scope != "function"
        }
        if scopes & {"module", "package"}:
            where = item.path.parent if "package" in scopes else item.path
            item.add_marker(pytest.mark.xdist_group(str(where.relative_to(config.rootpath))))


@pytest.hookimpl(trylast=True)  # after xdist has renamed the grouped tests
def pytest_collection_finish(session) -> None:
    """Fail a `--dist loadgroup` run whose groups xdist did not apply.

    xdist groups a test by appending "@group" to its node id; a pytest that stops
    reading the renamed id (9.2 did) spreads every group over the workers without a word,
    building each heavy module fixture once per worker.
    """
    if not getattr(session.config.option, "loadgroup", False):
        return
    for item in session.items:
        if item.get_closest_marker("xdist_group") is not None and "@" not in item.nodeid:
            raise pytest.UsageError(
                f"xdist did not group {item.nodeid}: this pytest and pytest-xdist do not "
                "work together (see the pin in pyproject.toml)"
            )
