"""Alembic environment: Skiff passes its engine in; no alembic.ini is needed."""

from alembic import context

from control_plane.store.orm import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    engine = config.attributes.get("engine")
    if engine is None:
        from sqlalchemy import create_engine

        engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.begin() as connection:
        context.configure(
            connection=connection,
            target_metadata=target_metadata,
            # SQLite cannot ALTER most things in place; batch mode copies the table.
            render_as_batch=connection.dialect.name == "sqlite",
        )
        context.run_migrations()


run_migrations_online()
