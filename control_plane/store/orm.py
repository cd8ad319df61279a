"""SQLAlchemy 2 typed ORM for the registry; private to the store package."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import (
    BigInteger,
    DateTime,
    ForeignKey,
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
    manifest: Mapped[bytes] = mapped_column(LargeBinary)
    manifest_signature: Mapped[bytes] = mapped_column(LargeBinary)
    signing_key_id: Mapped[str] = mapped_column(String(64))

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
