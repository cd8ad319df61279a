"""Alembic environment: Skiff passes its engine in; no alembic.ini is needed."""

from alembic import context

from control_plane.store.orm import Base

# The advisory lock every PostgreSQL migration takes (an arbitrary number, Skiff's own).
MIGRATION_LOCK = 0x5B1FF_0001
config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        from sqlalchemy import create_engine

        engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as connection:
        if connection.dialect.name == "postgresql":
            # Servers starting together (replicas, `--workers`) upgrade one at a time:
            # the others wait here, then find the schema current. Held to commit.
            connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK})")
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            # SQLite cannot ALTER most things in place; batch mode copies the table.
            render_as_batch=connection.dialect.name == "sqlite",
        )
        context.run_migrations()


run_migrations_online()
