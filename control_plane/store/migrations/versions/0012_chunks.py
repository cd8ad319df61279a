"""content-defined chunks: each variant's chunk table, each version's wrapped chunk
secret; a rollout's download policy

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-27 00:30:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(sa.Column("wrapped_chunk_secret", sa.LargeBinary(), nullable=True))
    with op.batch_alter_table("model_variants") as batch:
        batch.add_column(sa.Column("chunks", sa.JSON(), nullable=True))
    with op.batch_alter_table("rollouts") as batch:
        for name in ("download_on", "download_while"):
            batch.add_column(sa.Column(name, sa.String(16), nullable=False, server_default="any"))


def downgrade() -> None:
    with op.batch_alter_table("rollouts") as batch:
        batch.drop_column("download_while")
        batch.drop_column("download_on")
    with op.batch_alter_table("model_variants") as batch:
        batch.drop_column("chunks")
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("wrapped_chunk_secret")
