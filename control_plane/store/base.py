"""The registry store interface and the frozen records it returns.

ORM rows never leave the store: every method returns the dataclasses below, so callers
cannot lazy-load, mutate or hold a session by accident.
"""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass

from control_plane.crypto.kek import WrappedKey


@dataclass(frozen=True)
class VariantRecord:
    """One stored form of a version (fp32 as pushed, or a derived fp16/int8/int4)."""

    name: str
    plaintext_size: int
    plaintext_sha256: str
    ciphertext_size: int
    ciphertext_sha256: str
    segment_size: int
    signature: dict


@dataclass(frozen=True)
class NewVersion:
    """What a push hands to the store once the version number is known."""

    uid: str
    created_at: dt.datetime
    created_by: str
    notes: str
    source_format: str
    signature: dict
    variants: tuple[VariantRecord, ...]
    data_key: WrappedKey
    manifest: bytes
    manifest_signature: bytes
    signing_key_id: str


@dataclass(frozen=True)
class VersionRecord:
    """An immutable model version as stored."""

    model: str
    number: int
    created_at: dt.datetime
    uid: str
    created_by: str
    notes: str
    source_format: str
    signature: dict
    variants: tuple[VariantRecord, ...]
    data_key: WrappedKey
    manifest: bytes
    manifest_signature: bytes
    signing_key_id: str

    def variant(self, name: str) -> VariantRecord | None:
        """Return the named variant, or None."""
        return next((v for v in self.variants if v.name == name), None)


@dataclass(frozen=True)
class ModelRecord:
    """A model name with a summary of its versions."""

    name: str
    created_at: dt.datetime
    latest_version: int
    version_count: int


@dataclass(frozen=True)
class TokenRecord:
    """An API token as stored: only its SHA-256, never the token itself."""

    name: str
    role: str
    token_sha256: str


# Builds the version to insert once its number is allocated (the signed manifest names
# the number, so it can only be made inside the allocating transaction).
VersionBuilder = Callable[[int], NewVersion]
# Re-wraps one data key; called for every version during KEK rotation.
Rewrapper = Callable[[str, WrappedKey], WrappedKey]


class RegistryStore(abc.ABC):
    """Persistent state of the model registry."""

    @abc.abstractmethod
    def create_version(self, model: str, build: VersionBuilder) -> VersionRecord:
        """Create the model if needed and append the next version number (gapless)."""

    @abc.abstractmethod
    def list_models(self, *, after: str = "", limit: int | None = None) -> list[ModelRecord]:
        """Return models that have at least one version, by name (keyset pages).

        Only names after `after`, at most `limit` of them (None: every one).
        """

    @abc.abstractmethod
    def get_model(self, name: str) -> ModelRecord:
        """Return one model; NotFound if it has no versions."""

    @abc.abstractmethod
    def list_versions(
        self, name: str, *, after: int = 0, limit: int | None = None
    ) -> list[VersionRecord]:
        """Return a model's versions oldest first; NotFound for an unknown model.

        Only numbers after `after`, at most `limit` of them (None: every one).
        """

    @abc.abstractmethod
    def get_version(self, name: str, number: int | None = None) -> VersionRecord:
        """Return one version (the latest when number is None); NotFound otherwise."""

    @abc.abstractmethod
    def referenced_blobs(self) -> set[str]:
        """Return the ciphertext digests every stored variant points at."""

    @abc.abstractmethod
    def rewrap_data_keys(self, rewrap: Rewrapper) -> int:
        """Replace every wrapped data key in one transaction; returns how many."""

    @abc.abstractmethod
    def add_token(self, *, name: str, role: str, token_sha256: str) -> TokenRecord:
        """Store a token hash; AlreadyExists for a duplicate name or hash."""

    @abc.abstractmethod
    def find_token(self, token_sha256: str) -> TokenRecord | None:
        """Look a token up by its hash."""

    @abc.abstractmethod
    def check(self) -> None:
        """Probe the database; Unavailable when it cannot be reached."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections."""
