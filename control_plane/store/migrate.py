"""Runs Alembic migrations programmatically (the server upgrades the schema on start)."""

from __future__ import annotations

import functools
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(engine: Engine | None = None) -> Config:
    """Return an Alembic config pointing at Skiff's migrations (and engine, if given)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if engine is not None:
        config.attributes["engine"] = engine
    return config


@functools.cache
def head_revisions() -> frozenset[str]:
    """Return the head revision(s) of the migrations (their scripts read once a process)."""
    return frozenset(ScriptDirectory.from_config(alembic_config()).get_heads())


def current_revisions(engine: Engine) -> frozenset[str]:
    """Return the revision(s) the schema is at; empty for a database never migrated."""
    with engine.connect() as connection:
        return frozenset(MigrationContext.configure(connection).get_current_heads())


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema up to `revision`; a no-op when it is already there.

    A database already at head (every start but a new home's first, and each command
    that opens the store) is told so by one read of its version table: Alembic's own
    run loads every migration script and its environment again, ~0.2 s a time.
    """
    if revision == "head" and current_revisions(engine) == head_revisions():
        return
    command.upgrade(alembic_config(engine), revision)
