"""Runs Alembic migrations programmatically (the server upgrades the schema on start)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy.engine import Engine

MIGRATIONS = Path(__file__).with_name("migrations")


def alembic_config(engine: Engine | None = None) -> Config:
    """Return an Alembic config pointing at Skiff's migrations (and engine, if given)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    if engine is not None:
        config.attributes["engine"] = engine
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema up to `revision`; a no-op when it is already there."""
    command.upgrade(alembic_config(engine), revision)
