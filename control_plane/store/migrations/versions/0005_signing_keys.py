"""signing key chain

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-22 20:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "signing_keys",
        sa.Column("seq", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=False),
        sa.Column("public_key_pem", sa.LargeBinary(), nullable=False),
        sa.Column("private_key_ref", sa.String(length=512), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("not_after", sa.DateTime(timezone=True), nullable=True),
        sa.Column("endorsement", sa.LargeBinary(), nullable=False),
        sa.Column("endorsement_signature", sa.LargeBinary(), nullable=False),
        sa.Column("endorsed_by", sa.String(length=64), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        # One row per key: registering the same root twice (two replicas) conflicts.
        sa.UniqueConstraint("key_id"),
    )


def downgrade() -> None:
    op.drop_table("signing_keys")
