"""SQLAlchemy 2 typed ORM for the registry; private to the store package."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import JSON


def utcnow() -> dt.datetime:
    """Return the current time, timezone-aware UTC."""
    return dt.datetime.now(dt.UTC)


class Base(DeclarativeBase):
    """Declarative base of every Skiff table."""


class ModelRow(Base):
    """A model name; its versions hang off it."""

    __tablename__ = "models"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Serves name lookups (show, pull, push of a new version).
    name: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    versions: Mapped[list[VersionRow]] = relationship(
        back_populates="model", order_by="VersionRow.number"
    )


class VersionRow(Base):
    """One immutable version, with its wrapped data key and signed manifest."""

    __tablename__ = "model_versions"
    # Serves "latest version of model X" and keeps numbers unique under concurrent pushes.
    __table_args__ = (UniqueConstraint("model_id", "number", name="uq_version_number"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_id: Mapped[int] = mapped_column(ForeignKey("models.id", ondelete="RESTRICT"))
    number: Mapped[int] = mapped_column(Integer)
    uid: Mapped[str] = mapped_column(String(32), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    created_by: Mapped[str] = mapped_column(String(128))
    notes: Mapped[str] = mapped_column(Text, default="")
    source_format: Mapped[str] = mapped_column(String(16))
    signature: Mapped[dict] = mapped_column(JSON)
    kek_id: Mapped[str] = mapped_column(String(256))
    wrapped_data_key: Mapped[bytes] = mapped_column(LargeBinary)
    # The model's chunk secret, wrapped under the same KEK as the data key (kek_id).
    wrapped_chunk_secret: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    manifest: Mapped[bytes] = mapped_column(LargeBinary)
    manifest_signature: Mapped[bytes] = mapped_column(LargeBinary)
    signing_key_id: Mapped[str] = mapped_column(String(64))
    golden: Mapped[dict] = mapped_column(JSON, default=dict)

    model: Mapped[ModelRow] = relationship(back_populates="versions")
    variants: Mapped[list[VariantRow]] = relationship(
        back_populates="version", order_by="VariantRow.id", cascade="all, delete-orphan"
    )


class VariantRow(Base):
    """One stored form of a version: where its ciphertext is and what it decrypts to."""

    __tablename__ = "model_variants"
    # Serves loading a version's variants, one name each.
    __table_args__ = (UniqueConstraint("version_id", "name", name="uq_variant_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version_id: Mapped[int] = mapped_column(ForeignKey("model_versions.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(16))
    plaintext_size: Mapped[int] = mapped_column(BigInteger)
    plaintext_sha256: Mapped[str] = mapped_column(String(64))
    ciphertext_size: Mapped[int] = mapped_column(BigInteger)
    ciphertext_sha256: Mapped[str] = mapped_column(String(64))
    segment_size: Mapped[int] = mapped_column(Integer)
    signature: Mapped[dict] = mapped_column(JSON)
    accuracy: Mapped[dict] = mapped_column(JSON, default=dict)
    degraded: Mapped[bool] = mapped_column(Boolean, default=False)
    # Its chunk table and encrypted key list (VariantRecord.chunks); NULL before chunks.
    chunks: Mapped[dict | None] = mapped_column(JSON, nullable=True)

    version: Mapped[VersionRow] = relationship(back_populates="variants")


class TokenRow(Base):
    """An API token, stored only as its SHA-256."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(64), unique=True)
    role: Mapped[str] = mapped_column(String(16))
    # Serves authentication: every authenticated call looks its token up by hash.
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # The id operators see (token ls, revoke); serves revoke's lookup.
    token_id: Mapped[str] = mapped_column(String(32), unique=True)
    created_by: Mapped[str] = mapped_column(String(128), default="")
    # NULL = never expires.
    expires_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class KekStateRow(Base):
    """One row: the KEK every replica wraps new data keys with, and the other KEKs in use.

    Pushes read it (FOR SHARE) in the transaction that inserts their version and a
    rotation switches it (FOR UPDATE), so the two serialise on this row.
    """

    __tablename__ = "kek_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    active_kek_id: Mapped[str] = mapped_column(String(256))
    active_url: Mapped[str] = mapped_column(String(1024))
    # URLs of every other KEK a stored data key may be wrapped under.
    keyring: Mapped[list] = mapped_column(JSON)
    updated_at: Mapped[dt.datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, onupdate=utcnow
    )


class FleetStateRow(Base):
    """One row: the fleet revision, bumped by every change to any device's desired state."""

    __tablename__ = "fleet_state"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    revision: Mapped[int] = mapped_column(BigInteger, default=0)


class EnrollmentTokenRow(Base):
    """An enrollment token, stored only as its SHA-256, with its stamped attributes."""

    __tablename__ = "enrollment_tokens"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(64), default="")
    # Serves Enroll: the presented token is looked up by hash.
    token_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    attributes: Mapped[dict] = mapped_column(JSON)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    # NULL = unlimited.
    uses_left: Mapped[int | None] = mapped_column(Integer, nullable=True)
    uses: Mapped[int] = mapped_column(Integer, default=0)
    created_by: Mapped[str] = mapped_column(String(128))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class DeviceRow(Base):
    """An enrolled device: its credential hash, HPKE public key and latest attributes."""

    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    # Serves authentication of every device call (lookup by credential hash).
    credential_sha256: Mapped[str] = mapped_column(String(64), unique=True)
    public_keyset: Mapped[bytes] = mapped_column(LargeBinary)
    attributes: Mapped[dict] = mapped_column(JSON)
    # Attributes stamped by the enrollment token: they win over what the device reports.
    stamped_attributes: Mapped[dict] = mapped_column(JSON)
    enrollment_token_id: Mapped[str] = mapped_column(String(32))
    enrolled_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_seen: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # Refreshed by the replica holding the device's Watch stream while it stays open.
    online_until: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    revoked_reason: Mapped[str] = mapped_column(String(256), default="")
    # Report batches the control plane refused (invalid, overlapping, over the rate), and
    # the latest reason: `fleet show` tells an operator a device's telemetry is not counted.
    reports_refused: Mapped[int] = mapped_column(BigInteger, default=0)
    last_refusal: Mapped[str] = mapped_column(String(256), default="")
    last_refusal_at: Mapped[dt.datetime | None] = mapped_column(
        DateTime(timezone=True), nullable=True
    )
    # How far the device's clock was from the control plane's at its latest report.
    clock_offset_s: Mapped[float | None] = mapped_column(Float, nullable=True)


class DeviceModelRow(Base):
    """Per device and model: what it last fetched through Sync and what it reports installed."""

    __tablename__ = "device_models"
    __table_args__ = (
        # Serve a rollout's `synced` and `installed` counts (devices on model X version N).
        Index("ix_device_models_synced", "model", "synced_version"),
        Index("ix_device_models_installed", "model", "installed_version"),
        Index("ix_device_models_failed", "model", "failed_version"),
    )

    device_id: Mapped[str] = mapped_column(
        ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True
    )
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    synced_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    synced_variant: Mapped[str | None] = mapped_column(String(16), nullable=True)
    synced_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    installed_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    installed_variant: Mapped[str | None] = mapped_column(String(16), nullable=True)
    reported_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # The version the device's telemetry last said failed to install or was rolled back
    # (cleared when it reports that version activated after all).
    failed_version: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failed_variant: Mapped[str | None] = mapped_column(String(16), nullable=True)
    failed_reason: Mapped[str] = mapped_column(Text, default="")
    failed_at: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class RolloutRow(Base):
    """A rollout of one model version to the devices its selector picks, in stages."""

    __tablename__ = "rollouts"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    # Serves `rollout ls --model` and loading a model's rollouts.
    model: Mapped[str] = mapped_column(String(64), index=True)
    version: Mapped[int] = mapped_column(Integer)
    variant: Mapped[str] = mapped_column(String(16))
    selector: Mapped[str] = mapped_column(Text)
    stages: Mapped[list] = mapped_column(JSON)
    stage: Mapped[int] = mapped_column(Integer, default=0)
    # Serves the resolver's load of every rollout that can still assign a version.
    state: Mapped[str] = mapped_column(String(16), index=True)
    bake_s: Mapped[int] = mapped_column(Integer)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    created_by: Mapped[str] = mapped_column(String(128))
    stage_started_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    # Guardrails (control_plane.rollouts.guardrails): rule texts, minimum sample, the
    # device-class attribute slices are cut by ("" = the whole rollout is one slice).
    halt_rules: Mapped[list] = mapped_column(JSON, default=list)
    min_devices: Mapped[int] = mapped_column(Integer, default=0)
    min_inferences: Mapped[int] = mapped_column(BigInteger, default=0)
    slice_by: Mapped[str] = mapped_column(String(64), default="")
    # Slice value -> {"state": "rolled_back" | "active", "since": ISO time}; absent = active.
    slices: Mapped[dict] = mapped_column(JSON, default=dict)
    # Download policy: "any" | "wifi", "any" | "charging".
    download_on: Mapped[str] = mapped_column(String(16), default="any")
    download_while: Mapped[str] = mapped_column(String(16), default="any")
    events: Mapped[list[RolloutEventRow]] = relationship(
        back_populates="rollout", order_by="RolloutEventRow.id", cascade="all, delete-orphan"
    )


class RolloutEventRow(Base):
    """The audit log of a rollout: who changed what, when, and why."""

    __tablename__ = "rollout_events"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # Serves loading one rollout's audit log.
    rollout_id: Mapped[str] = mapped_column(
        ForeignKey("rollouts.id", ondelete="CASCADE"), index=True
    )
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    actor: Mapped[str] = mapped_column(String(128))
    action: Mapped[str] = mapped_column(String(32))
    from_state: Mapped[str] = mapped_column(String(16), default="")
    to_state: Mapped[str] = mapped_column(String(16))
    stage: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(Text, default="")
    # The slice a guardrail or operator acted on ("" = the whole rollout).
    slice: Mapped[str] = mapped_column(String(600), default="")
    # A guardrail's evidence: rule, figures of both cohorts, sample sizes.
    evidence: Mapped[dict] = mapped_column(JSON, default=dict)

    rollout: Mapped[RolloutRow] = relationship(back_populates="events")


class SigningKeyRow(Base):
    """One key of the signing chain; the row with the highest seq is the active key."""

    __tablename__ = "signing_keys"

    # Insertion order is chain order; the active key is the last row.
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key_id: Mapped[str] = mapped_column(String(64), unique=True)
    public_key_pem: Mapped[bytes] = mapped_column(LargeBinary)
    # Where the private key lives (file path or aws-kms:// URL); never the key itself.
    private_key_ref: Mapped[str] = mapped_column(String(512))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    not_after: Mapped[dt.datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    endorsement: Mapped[bytes] = mapped_column(LargeBinary)
    endorsement_signature: Mapped[bytes] = mapped_column(LargeBinary)
    endorsed_by: Mapped[str] = mapped_column(String(64))


class TelemetryBatchRow(Base):
    """One telemetry batch a device sent; its key makes a batch sent twice apply once."""

    __tablename__ = "telemetry_batches"

    device_id: Mapped[str] = mapped_column(
        ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True
    )
    batch_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Serves pruning by age.
    received_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), index=True)
    period_start: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    period_end: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    dropped_batches: Mapped[int] = mapped_column(Integer, default=0)
    # Serves the roller's search for batches not yet rolled up (a flag, not an id
    # watermark: PostgreSQL ids are not assigned in commit order).
    rolled: Mapped[bool] = mapped_column(Boolean, default=False, index=True)


class ModelStatsRow(Base):
    """Serving stats of one model version and backend config in one telemetry batch.

    Raw and per batch, so fleet-wide rollups can merge them any way (histograms add).
    """

    __tablename__ = "telemetry_model_stats"
    __table_args__ = (
        # Serves rollups of one model version over a time range.
        Index("ix_telemetry_model_stats_version", "model", "version", "period_end"),
        # Serves `fleet show`: one device's recent stats.
        Index("ix_telemetry_model_stats_device", "device_id", "period_end"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    batch_id: Mapped[str] = mapped_column(String(64))
    period_start: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    period_end: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    variant: Mapped[str] = mapped_column(String(16))
    config: Mapped[str] = mapped_column(String(128))
    inferences: Mapped[int] = mapped_column(BigInteger)
    errors: Mapped[int] = mapped_column(BigInteger)
    crashes: Mapped[int] = mapped_column(Integer)
    fallbacks: Mapped[int] = mapped_column(Integer)
    pipeline_firings: Mapped[int] = mapped_column(BigInteger)
    # runtime.LatencyHistogram.to_dict(): mergeable.
    latency: Mapped[dict] = mapped_column(JSON)
    # The crash and fallback reports themselves.
    events: Mapped[dict] = mapped_column(JSON)


class InstallReportRow(Base):
    """One install outcome a device reported: activated, failed or rolled back."""

    __tablename__ = "install_reports"
    __table_args__ = (
        Index("ix_install_reports_device", "device_id", "at"),
        Index("ix_install_reports_version", "model", "version", "at"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    batch_id: Mapped[str] = mapped_column(String(64))
    at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    variant: Mapped[str] = mapped_column(String(16))
    rollout: Mapped[str] = mapped_column(String(32))
    result: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text)
    config: Mapped[str] = mapped_column(String(128))
    # Seconds per step and bytes: download_s, verify_s, self_test_s, downloaded_bytes, ...
    timings: Mapped[dict] = mapped_column(JSON)
    probes: Mapped[list] = mapped_column(JSON)


class RollupRow(Base):
    """Merged telemetry of one group of devices over one time bucket.

    A group is model, version, variant, backend config and device class; with `rollout`
    set, it is also one cohort of that rollout (candidate or baseline), which is what
    guardrails compare. Histograms are stored sparse (control_plane.telemetry.roller).
    """

    __tablename__ = "telemetry_rollups"
    __table_args__ = (
        # Serves the roller's merge: one row per bucket and group key.
        UniqueConstraint("resolution_s", "bucket_start", "key", name="uq_rollups_bucket_key"),
        # Serves a rollout's health view and a version's charts over a time range.
        Index("ix_rollups_rollout", "rollout", "resolution_s", "bucket_start"),
        Index("ix_rollups_version", "model", "version", "resolution_s", "bucket_start"),
        # Serves retention.
        Index("ix_rollups_age", "resolution_s", "bucket_start"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    resolution_s: Mapped[int] = mapped_column(Integer)
    bucket_start: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    # SHA-256 of every dimension below: the group's identity within a bucket.
    key: Mapped[str] = mapped_column(String(64))
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    variant: Mapped[str] = mapped_column(String(16))
    config: Mapped[str] = mapped_column(String(128))
    # Canonical JSON of the device-class attributes, e.g. {"os_version": "14", "soc": "x"}.
    device_class: Mapped[str] = mapped_column(Text)
    rollout: Mapped[str] = mapped_column(String(32), default="")
    cohort: Mapped[str] = mapped_column(String(16), default="")
    inferences: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    crashes: Mapped[int] = mapped_column(BigInteger, default=0)
    fallbacks: Mapped[int] = mapped_column(BigInteger, default=0)
    pipeline_firings: Mapped[int] = mapped_column(BigInteger, default=0)
    installs_activated: Mapped[int] = mapped_column(BigInteger, default=0)
    installs_failed: Mapped[int] = mapped_column(BigInteger, default=0)
    installs_rolled_back: Mapped[int] = mapped_column(BigInteger, default=0)
    # Signal name -> count.
    crash_signals: Mapped[dict] = mapped_column(JSON, default=dict)
    latency_count: Mapped[int] = mapped_column(BigInteger, default=0)
    latency_sum_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    latency_min_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    latency_max_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    latency_buckets: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    # Language models (rollup_aggregate.Aggregate): tokens, cancellations, time to first token.
    tokens_in: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_out: Mapped[int] = mapped_column(BigInteger, default=0)
    cancellations: Mapped[int] = mapped_column(BigInteger, default=0)
    ttft_count: Mapped[int] = mapped_column(BigInteger, default=0)
    ttft_sum_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    ttft_min_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    ttft_max_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    ttft_buckets: Mapped[bytes] = mapped_column(LargeBinary, default=b"")


class DeviceRollupRow(Base):
    """One device's merged telemetry in one scope: a rollout's cohort window, or the fleet.

    Guardrails and backend recommendations judge devices, not samples (one device must
    not decide a verdict), so they need each device's own figures: a row per device and
    backend config, per rollout cohort and window (scope = rollout id), or fleet-wide per
    model version (scope ""). Histograms are stored sparse, as in `telemetry_rollups`.
    """

    __tablename__ = "device_rollups"
    __table_args__ = (
        # Serves a version's recommendations (scope "", then model and version).
        Index("ix_device_rollups_scope", "scope", "model", "version"),
        # Serves a rollout's health view (its current window's candidate and baseline rows,
        # an older window's baseline, the outside cohort's totals).
        Index("ix_device_rollups_cohort", "scope", "cohort", "window_start"),
        # Serves retention.
        Index("ix_device_rollups_seen", "scope", "last_seen"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    # SHA-256 of every dimension below (control_plane.store.rollup_records.DeviceKey.digest);
    # serves the roller's merge.
    key: Mapped[str] = mapped_column(String(64), unique=True)
    scope: Mapped[str] = mapped_column(String(32))
    window_start: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    cohort: Mapped[str] = mapped_column(String(16))
    model: Mapped[str] = mapped_column(String(64))
    version: Mapped[int] = mapped_column(Integer)
    variant: Mapped[str] = mapped_column(String(16))
    config: Mapped[str] = mapped_column(String(128))
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    # Canonical JSON: the device class (fleet rows) or the rollout's slice (rollout rows).
    device_class: Mapped[str] = mapped_column(Text)
    last_seen: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
    # Stats entries and install outcomes merged into the row.
    reports: Mapped[int] = mapped_column(BigInteger, default=0)
    inferences: Mapped[int] = mapped_column(BigInteger, default=0)
    errors: Mapped[int] = mapped_column(BigInteger, default=0)
    crashes: Mapped[int] = mapped_column(BigInteger, default=0)
    fallbacks: Mapped[int] = mapped_column(BigInteger, default=0)
    pipeline_firings: Mapped[int] = mapped_column(BigInteger, default=0)
    installs_activated: Mapped[int] = mapped_column(BigInteger, default=0)
    installs_failed: Mapped[int] = mapped_column(BigInteger, default=0)
    installs_rolled_back: Mapped[int] = mapped_column(BigInteger, default=0)
    crash_signals: Mapped[dict] = mapped_column(JSON, default=dict)
    latency_count: Mapped[int] = mapped_column(BigInteger, default=0)
    latency_sum_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    latency_min_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    latency_max_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    latency_buckets: Mapped[bytes] = mapped_column(LargeBinary, default=b"")
    # Language models (rollup_aggregate.Aggregate): tokens, cancellations, time to first token.
    tokens_in: Mapped[int] = mapped_column(BigInteger, default=0)
    tokens_out: Mapped[int] = mapped_column(BigInteger, default=0)
    cancellations: Mapped[int] = mapped_column(BigInteger, default=0)
    ttft_count: Mapped[int] = mapped_column(BigInteger, default=0)
    ttft_sum_ns: Mapped[int] = mapped_column(BigInteger, default=0)
    ttft_min_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    ttft_max_ns: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    ttft_buckets: Mapped[bytes] = mapped_column(LargeBinary, default=b"")


class ReportPeriodRow(Base):
    """Where the last accepted report period of one device ended.

    The server, not the device, decides how much time a report may cover: a new period
    may not start before this (no overlaps, no backdating), so however a device words its
    periods, they add up to no more than the time since it enrolled. One row per device
    today, under model "" (every model: control_plane.telemetry.budget); the key leaves
    room for a budget per model.
    """

    __tablename__ = "report_periods"

    # Serves the check of every Report.
    device_id: Mapped[str] = mapped_column(
        ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True
    )
    model: Mapped[str] = mapped_column(String(64), primary_key=True)
    period_end: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))


class WebSessionRow(Base):
    """A dashboard login: the SHA-256 of its cookie, bound to the API token it was made with.

    The token is checked again on every request, so revoking it ends its sessions too.
    """

    __tablename__ = "web_sessions"
    __table_args__ = (
        # Serves the prune of expired sessions at login.
        Index("ix_web_sessions_expires_at", "expires_at"),
    )

    # Serves the lookup every dashboard request makes.
    session_sha256: Mapped[str] = mapped_column(String(64), primary_key=True)
    token_sha256: Mapped[str] = mapped_column(
        ForeignKey("api_tokens.token_sha256", ondelete="CASCADE")
    )
    created_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[dt.datetime] = mapped_column(DateTime(timezone=True))
