"""language models' telemetry in rollups: tokens, cancellations, time to first token

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-26 20:40:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_TABLES = ("telemetry_rollups", "device_rollups")
_COUNTS = ("tokens_in", "tokens_out", "cancellations", "ttft_count", "ttft_sum_ns")


def upgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            for name in _COUNTS:
                batch.add_column(
                    sa.Column(name, sa.BigInteger(), nullable=False, server_default="0")
                )
            batch.add_column(sa.Column("ttft_min_ns", sa.BigInteger(), nullable=True))
            batch.add_column(sa.Column("ttft_max_ns", sa.BigInteger(), nullable=True))
            batch.add_column(
                sa.Column(
                    "ttft_buckets", sa.LargeBinary(), nullable=False, server_default=sa.text("''")
                )
            )


def downgrade() -> None:
    for table in _TABLES:
        with op.batch_alter_table(table) as batch:
            for name in (*_COUNTS, "ttft_min_ns", "ttft_max_ns", "ttft_buckets"):
                batch.drop_column(name)
