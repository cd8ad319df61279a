"""per-device rollups (cohorts by assignment, robust verdicts), report periods, refusals

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-26 09:00:00
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
_COUNTERS = (
    "reports",
    "inferences",
    "errors",
    "crashes",
    "fallbacks",
    "pipeline_firings",
    "installs_activated",
    "installs_failed",
    "installs_rolled_back",
)


def upgrade() -> None:
    # Cohort devices were counted by the version they reported, not the one assigned:
    # nothing in the old table can be carried over (the next reports fill the new one).
    op.drop_table("rollout_devices")
    op.create_table(
        "device_rollups",
        sa.Column("id", _ID, autoincrement=True, nullable=False),
        sa.Column("key", sa.String(64), nullable=False),
        sa.Column("scope", sa.String(32), nullable=False),
        sa.Column("window_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("cohort", sa.String(16), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("variant", sa.String(16), nullable=False),
        sa.Column("config", sa.String(128), nullable=False),
        sa.Column("device_id", sa.String(32), nullable=False),
        sa.Column("device_class", sa.Text(), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False),
        *(sa.Column(name, sa.BigInteger(), nullable=False) for name in _COUNTERS),
        sa.Column("crash_signals", sa.JSON(), nullable=False),
        sa.Column("latency_count", sa.BigInteger(), nullable=False),
        sa.Column("latency_sum_ns", sa.BigInteger(), nullable=False),
        sa.Column("latency_min_ns", sa.BigInteger(), nullable=True),
        sa.Column("latency_max_ns", sa.BigInteger(), nullable=True),
        sa.Column("latency_buckets", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("key"),
    )
    # One version's recommendations.
    op.create_index("ix_device_rollups_scope", "device_rollups", ["scope", "model", "version"])
    # A rollout's health view: its window's rows, an older baseline, the outside totals.
    op.create_index(
        "ix_device_rollups_cohort", "device_rollups", ["scope", "cohort", "window_start"]
    )
    # Retention.
    op.create_index("ix_device_rollups_seen", "device_rollups", ["scope", "last_seen"])
    op.create_table(
        "report_periods",
        sa.Column("device_id", sa.String(32), nullable=False),
        sa.Column("model", sa.String(64), nullable=False),
        sa.Column("period_end", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("device_id", "model"),
    )
    with op.batch_alter_table("devices") as batch:
        batch.add_column(
            sa.Column("reports_refused", sa.BigInteger(), nullable=False, server_default="0")
        )
        batch.add_column(
            sa.Column("last_refusal", sa.String(256), nullable=False, server_default="")
        )
        batch.add_column(sa.Column("last_refusal_at", sa.DateTime(timezone=True), nullable=True))
        batch.add_column(sa.Column("clock_offset_s", sa.Float(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("devices") as batch:
        for name in ("clock_offset_s", "last_refusal_at", "last_refusal", "reports_refused"):
            batch.drop_column(name)
    op.drop_table("report_periods")
    op.drop_table("device_rollups")
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
