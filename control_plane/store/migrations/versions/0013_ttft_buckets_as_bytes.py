"""rollup rows upgraded through 0011 on SQLite: an empty histogram as bytes, not text

0011 gave `ttft_buckets` a server default of `''`, which SQLite stores as text: every
row that existed before it held a text value where the column holds bytes, and a read of
such rows beside a language model's (which have real bytes) could not decode them
together. PostgreSQL stored an empty bytea and needs nothing.

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-27 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

_TABLES = ("telemetry_rollups", "device_rollups")


def upgrade() -> None:
    if op.get_bind().dialect.name != "sqlite":
        return
    for table in _TABLES:
        op.execute(
            sa.text(f"UPDATE {table} SET ttft_buckets = x'' WHERE typeof(ttft_buckets) = 'text'")
        )


def downgrade() -> None:
    pass  # bytes are what the column holds: nothing to undo
