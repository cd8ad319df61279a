"""golden data per version, accuracy and degraded flag per variant

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-22 23:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Versions pushed before golden data existed have none: {} and not degraded.
    with op.batch_alter_table("model_versions") as batch:
        batch.add_column(sa.Column("golden", sa.JSON(), nullable=False, server_default="{}"))
    with op.batch_alter_table("model_variants") as batch:
        batch.add_column(sa.Column("accuracy", sa.JSON(), nullable=False, server_default="{}"))
        batch.add_column(
            sa.Column("degraded", sa.Boolean(), nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("model_variants") as batch:
        batch.drop_column("degraded")
        batch.drop_column("accuracy")
    with op.batch_alter_table("model_versions") as batch:
        batch.drop_column("golden")
