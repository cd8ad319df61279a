"""kek state shared by replicas

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-22 20:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # One row (id 1). Existing databases get it from the first server that starts, out of
    # that server's configured KEK: a migration cannot open key files or call KMS.
    op.create_table(
        "kek_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("active_kek_id", sa.String(length=256), nullable=False),
        sa.Column("active_url", sa.String(length=1024), nullable=False),
        sa.Column("keyring", sa.JSON(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )


def downgrade() -> None:
    op.drop_table("kek_state")
