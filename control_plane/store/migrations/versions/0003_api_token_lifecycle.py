"""API tokens get an id, an author, an expiry and a revocation time

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22 20:10:00
"""

import secrets

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:
        batch.add_column(sa.Column("token_id", sa.String(length=32), nullable=True))
        batch.add_column(
            sa.Column("created_by", sa.String(length=128), nullable=False, server_default="")
        )
        batch.add_column(sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True))
    tokens = sa.table("api_tokens", sa.column("id", sa.Integer), sa.column("token_id", sa.String))
    conn = op.get_bind()
    for (row_id,) in conn.execute(sa.select(tokens.c.id)).all():
        conn.execute(
            tokens.update()
            .where(tokens.c.id == row_id)
            .values(token_id="tok_" + secrets.token_hex(6))
        )
    with op.batch_alter_table("api_tokens") as batch:
        batch.alter_column("token_id", existing_type=sa.String(length=32), nullable=False)
        # Serves revoke's lookup by id.
        batch.create_unique_constraint("uq_api_tokens_token_id", ["token_id"])


def downgrade() -> None:
    # 0002 has no way to say "revoked" or "expires": such tokens would come back to life
    # as permanent ones, so they go.
    tokens = sa.table(
        "api_tokens",
        sa.column("revoked_at", sa.DateTime(timezone=True)),
        sa.column("expires_at", sa.DateTime(timezone=True)),
    )
    op.get_bind().execute(
        tokens.delete().where(tokens.c.revoked_at.isnot(None) | tokens.c.expires_at.isnot(None))
    )
    with op.batch_alter_table("api_tokens") as batch:
        batch.drop_constraint("uq_api_tokens_token_id", type_="unique")
        batch.drop_column("revoked_at")
        batch.drop_column("expires_at")
        batch.drop_column("created_by")
        batch.drop_column("token_id")
