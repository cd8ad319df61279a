"""telemetry rollups, rollout cohort devices, rolled flag on batches; rollout guardrails

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-23 10:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("telemetry_batches") as batch:
        # Batches stored before rollups existed are rolled up by the first roller round.
        batch.add_column(
            sa.Column("rolled", sa.Boolean(), nullable=False, server_default=sa.false())
        )
        batch.create_index("ix_telemetry_batches_rolled", ["rolled"])
    with op.batch_alter_table("rollouts") as batch:
        batch.add_column(sa.Column("halt_rules", sa.JSON(), nullable=False, server_default="[]"))
        batch.add_column(sa.Column("min_devices", sa.Integer(), nullable=False, server_default="0"))
        batch.add_column(
            sa.Column("min_inferences", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(sa.Column("slice_by", sa.String(64), nullable=False, server_default=""))
        batch.add_column(sa.Column("slices", sa.JSON(), nullable=False, server_default="{}"))
    with op.batch_alter_table("rollout_events") as batch:
        batch.add_column(sa.Column("slice", sa.String(600), nullable=False, server_default=""))
        batch.add_column(sa.Column("evidence", sa.JSON(), nullable=False, server_default="{}"))
    counters = [
        sa.Column(name, sa.BigInteger(), nullable=False)
        for name in (
            "inferences",
            "errors",
            "crashes",
            "fallbacks",
            "pipeline_firings",
            "installs_activated",
            "installs_failed",
            "installs_rolled_back",
        )
    ]
    op.create_table(
        "telemetry_rollups",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("resolution_s", sa.Integer(), nullable=False),
        sa.Column("bucket_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("variant", sa.String(16), nullable=False),
        sa.Column("config", sa.String(128), nullable=False),
        sa.Column("device_class", sa.Text(), nullable=False),
        sa.Column("rollout", sa.String(32), nullable=False),
        sa.Column("cohort", sa.String(16), nullable=False),
        *counters,
        sa.Column("crash_signals", sa.JSON(), nullable=False),
        sa.Column("latency_count", sa.BigInteger(), nullable=False),
        sa.Column("latency_sum_ns", sa.BigInteger(), nullable=False),
        sa.Column("latency_min_ns", sa.BigInteger(), nullable=True),
        sa.Column("latency_max_ns", sa.BigInteger(), nullable=True),
        sa.Column("latency_buckets", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("resolution_s", "bucket_start", "key", name="uq_rollups_bucket_key"),
    )
    op.create_index(
        "ix_rollups_rollout", "telemetry_rollups", ["rollout", "resolution_s", "bucket_start"]
    )
    op.create_index(
        "ix_rollups_version",
        "telemetry_rollups",
        ["model", "version", "resolution_s", "bucket_start"],
    )
    op.create_index("ix_rollups_age", "telemetry_rollups", ["resolution_s", "bucket_start"])
    op.create_table(
        "rollout_devices",
        sa.Column("rollout", sa.String(32), nullable=False),
        sa.Column("cohort", sa.String(16), nullable=False),
        sa.Column("device_id", sa.String(32), nullable=False),
        sa.Column("device_class", sa.Text(), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        *(
            sa.Column(name, sa.BigInteger(), nullable=False, server_default="0")
            for name in ("crashes", "errors", "fallbacks", "install_failures")
        ),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("rollout", "cohort", "device_id"),
    )
    op.create_index("ix_rollout_devices_seen", "rollout_devices", ["rollout", "last_seen"])


def downgrade() -> None:
    op.drop_table("rollout_devices")
    op.drop_table("telemetry_rollups")
    with op.batch_alter_table("rollout_events") as batch:
        batch.drop_column("evidence")
        batch.drop_column("slice")
    with op.batch_alter_table("rollouts") as batch:
        for name in ("slices", "slice_by", "min_inferences", "min_devices", "halt_rules"):
            batch.drop_column(name)
    with op.batch_alter_table("telemetry_batches") as batch:
        batch.drop_index("ix_telemetry_batches_rolled")
        batch.drop_column("rolled")
