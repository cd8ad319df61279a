"""initial registry schema

Revision ID: 0001
Revises:
Create Date: 2026-11-21 20:37:01.859492
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "api_tokens",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("role", sa.String(length=16), nullable=False),
        sa.Column("token_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("name"),
        # Index serves authentication: every call looks its token up by hash.
        sa.UniqueConstraint("token_sha256"),
    )
    op.create_table(
        "models",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        # Index serves lookups by model name (show, pull, push).
        sa.UniqueConstraint("name"),
    )
    op.create_table(
        "model_versions",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("model_id", sa.Integer(), nullable=False),
        sa.Column("number", sa.Integer(), nullable=False),
        sa.Column("uid", sa.String(length=32), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("notes", sa.Text(), nullable=False),
        sa.Column("source_format", sa.String(length=16), nullable=False),
        sa.Column("signature", sa.JSON(), nullable=False),
        sa.Column("kek_id", sa.String(length=256), nullable=False),
        sa.Column("wrapped_data_key", sa.LargeBinary(), nullable=False),
        sa.Column("manifest", sa.LargeBinary(), nullable=False),
        sa.Column("manifest_signature", sa.LargeBinary(), nullable=False),
        sa.Column("signing_key_id", sa.String(length=64), nullable=False),
        sa.ForeignKeyConstraint(["model_id"], ["models.id"], ondelete="RESTRICT"),
        sa.PrimaryKeyConstraint("id"),
        # Index serves "latest/number N of model X" and keeps numbers unique under races.
        sa.UniqueConstraint("model_id", "number", name="uq_version_number"),
        # Index serves finding a version by its uid (bound into its key and ciphertexts).
        sa.UniqueConstraint("uid"),
    )
    op.create_table(
        "model_variants",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("version_id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=16), nullable=False),
        sa.Column("plaintext_size", sa.BigInteger(), nullable=False),
        sa.Column("plaintext_sha256", sa.String(length=64), nullable=False),
        sa.Column("ciphertext_size", sa.BigInteger(), nullable=False),
        sa.Column("ciphertext_sha256", sa.String(length=64), nullable=False),
        sa.Column("segment_size", sa.Integer(), nullable=False),
        sa.Column("signature", sa.JSON(), nullable=False),
        sa.ForeignKeyConstraint(["version_id"], ["model_versions.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        # Index serves loading a version's variants.
        sa.UniqueConstraint("version_id", "name", name="uq_variant_name"),
    )


def downgrade() -> None:
    op.drop_table("model_variants")
    op.drop_table("model_versions")
    op.drop_table("models")
    op.drop_table("api_tokens")
