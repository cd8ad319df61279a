"""telemetry batches, model stats, install reports; failed version per device and model

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def _device_fk() -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(["device_id"], ["devices.id"], ondelete="CASCADE")


def upgrade() -> None:
    with op.batch_alter_table("device_models") as batch:
        batch.add_column(sa.Column("failed_version", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("failed_variant", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("failed_reason", sa.Text(), nullable=False, server_default=""))
        batch.add_column(sa.Column("failed_at", sa.DateTime(timezone=True), nullable=True))
        batch.create_index("ix_device_models_failed", ["model", "failed_version"])
    op.create_table(
        "telemetry_batches",
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("dropped_batches", sa.Integer(), nullable=False),
        _device_fk(),
        sa.PrimaryKeyConstraint("device_id", "batch_id"),
    )
    op.create_index("ix_telemetry_batches_received_at", "telemetry_batches", ["received_at"])
    op.create_table(
        "telemetry_model_stats",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("period_end", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("variant", sa.String(length=16), nullable=False),
        sa.Column("config", sa.String(length=128), nullable=False),
        sa.Column("inferences", sa.BigInteger(), nullable=False),
        sa.Column("errors", sa.BigInteger(), nullable=False),
        sa.Column("crashes", sa.Integer(), nullable=False),
        sa.Column("fallbacks", sa.Integer(), nullable=False),
        sa.Column("pipeline_firings", sa.BigInteger(), nullable=False),
        sa.Column("latency", sa.JSON(), nullable=False),
        sa.Column("events", sa.JSON(), nullable=False),
        _device_fk(),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index(
        "ix_telemetry_model_stats_version",
        "telemetry_model_stats",
        ["model", "version", "period_end"],
    )
    op.create_index(
        "ix_telemetry_model_stats_device", "telemetry_model_stats", ["device_id", "period_end"]
    )
    op.create_table(
        "install_reports",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("batch_id", sa.String(length=64), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("variant", sa.String(length=16), nullable=False),
        sa.Column("rollout", sa.String(length=32), nullable=False),
        sa.Column("result", sa.String(length=16), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("config", sa.String(length=128), nullable=False),
        sa.Column("timings", sa.JSON(), nullable=False),
        sa.Column("probes", sa.JSON(), nullable=False),
        _device_fk(),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_index("ix_install_reports_device", "install_reports", ["device_id", "at"])
    op.create_index("ix_install_reports_version", "install_reports", ["model", "version", "at"])


def downgrade() -> None:
    op.drop_table("install_reports")
    op.drop_table("telemetry_model_stats")
    op.drop_table("telemetry_batches")
    with op.batch_alter_table("device_models") as batch:
        batch.drop_index("ix_device_models_failed")
        batch.drop_column("failed_at")
        batch.drop_column("failed_reason")
        batch.drop_column("failed_variant")
        batch.drop_column("failed_version")
