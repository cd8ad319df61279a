"""fleet and rollouts

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22 16:54:04
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "devices",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("credential_sha256", sa.String(length=64), nullable=False),
        sa.Column("public_keyset", sa.LargeBinary(), nullable=False),
        sa.Column("attributes", sa.JSON(), nullable=False),
        sa.Column("stamped_attributes", sa.JSON(), nullable=False),
        sa.Column("enrollment_token_id", sa.String(length=32), nullable=False),
        sa.Column("enrolled_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=True),
        sa.Column("online_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_reason", sa.String(length=256), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        # Index serves authentication of every device call (lookup by credential hash).
        sa.UniqueConstraint("credential_sha256"),
    )
    op.create_table(
        "enrollment_tokens",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("token_sha256", sa.String(length=64), nullable=False),
        sa.Column("attributes", sa.JSON(), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("uses_left", sa.Integer(), nullable=True),
        sa.Column("uses", sa.Integer(), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        # Index serves Enroll (lookup of the presented token by hash).
        sa.UniqueConstraint("token_sha256"),
    )
    op.create_table(
        "fleet_state",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("revision", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    op.create_table(
        "rollouts",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.Column("variant", sa.String(length=16), nullable=False),
        sa.Column("selector", sa.Text(), nullable=False),
        sa.Column("stages", sa.JSON(), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("state", sa.String(length=16), nullable=False),
        sa.Column("bake_s", sa.Integer(), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_by", sa.String(length=128), nullable=False),
        sa.Column("stage_started_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    fleet_state = sa.table(
        "fleet_state", sa.column("id", sa.Integer), sa.column("revision", sa.BigInteger)
    )
    op.bulk_insert(fleet_state, [{"id": 1, "revision": 0}])
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        # Serves `rollout ls --model` and loading one model's rollouts.
        batch_op.create_index(batch_op.f("ix_rollouts_model"), ["model"], unique=False)
        # Serves the resolver's load of every rollout that can still assign a version.
        batch_op.create_index(batch_op.f("ix_rollouts_state"), ["state"], unique=False)

    op.create_table(
        "device_models",
        sa.Column("device_id", sa.String(length=32), nullable=False),
        sa.Column("model", sa.String(length=64), nullable=False),
        sa.Column("synced_version", sa.Integer(), nullable=True),
        sa.Column("synced_variant", sa.String(length=16), nullable=True),
        sa.Column("synced_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("installed_version", sa.Integer(), nullable=True),
        sa.Column("installed_variant", sa.String(length=16), nullable=True),
        sa.Column("reported_at", sa.DateTime(timezone=True), nullable=True),
        sa.ForeignKeyConstraint(["device_id"], ["devices.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("device_id", "model"),
    )
    with op.batch_alter_table("device_models", schema=None) as batch_op:
        # Serve a rollout's `installed` and `synced` counts (devices on model X version N).
        batch_op.create_index(
            "ix_device_models_installed", ["model", "installed_version"], unique=False
        )
        batch_op.create_index("ix_device_models_synced", ["model", "synced_version"], unique=False)

    op.create_table(
        "rollout_events",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("rollout_id", sa.String(length=32), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=128), nullable=False),
        sa.Column("action", sa.String(length=32), nullable=False),
        sa.Column("from_state", sa.String(length=16), nullable=False),
        sa.Column("to_state", sa.String(length=16), nullable=False),
        sa.Column("stage", sa.Integer(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["rollout_id"], ["rollouts.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("rollout_events", schema=None) as batch_op:
        # Serves loading one rollout's audit log.
        batch_op.create_index(
            batch_op.f("ix_rollout_events_rollout_id"), ["rollout_id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("rollout_events", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollout_events_rollout_id"))

    op.drop_table("rollout_events")
    with op.batch_alter_table("device_models", schema=None) as batch_op:
        batch_op.drop_index("ix_device_models_synced")
        batch_op.drop_index("ix_device_models_installed")

    op.drop_table("device_models")
    with op.batch_alter_table("rollouts", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_rollouts_state"))
        batch_op.drop_index(batch_op.f("ix_rollouts_model"))

    op.drop_table("rollouts")
    op.drop_table("fleet_state")
    op.drop_table("enrollment_tokens")
    op.drop_table("devices")
