"""The registry store interface and the frozen records it returns.

ORM rows never leave the store: every method returns the dataclasses below, so callers
cannot lazy-load, mutate or hold a session by accident.
"""

from __future__ import annotations

import abc
import base64
import contextlib
import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from contract import errors
from contract.chunks import ID_SIZE, TAG_SIZE


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
    # How this variant's outputs compare with fp32's on the golden inputs: worst cosine
    # and max abs error, and per output ({} for fp32 itself and older versions).
    accuracy: dict = field(default_factory=dict)
    # Below the accuracy bar but kept on the publisher's word (--allow-degraded): shown
    # everywhere, and served only to rollouts that name it.
    degraded: bool = False
    # The variant as content-defined chunks (contract.chunks), as its manifest signs it:
    # {"table": the chunk table, "keys": the blob record of its encrypted key list}; {}
    # for versions pushed before chunks.
    chunks: dict = field(default_factory=dict)


def chunk_secret_context(uid: str) -> str:
    """Return the KEK context a version's copy of its model's chunk secret is wrapped under."""
    return f"{uid}/chunk-secret"


def chunk_sizes(chunks: dict) -> dict[str, int]:
    """Return {blob: ciphertext size} of the chunks a variant's chunk record lists."""
    if not chunks:
        return {}
    table = chunks["table"]
    ids = base64.b64decode(table["ids"])
    return {
        ids[i * ID_SIZE : (i + 1) * ID_SIZE].hex(): size + TAG_SIZE
        for i, size in enumerate(table["sizes"])
    }


def chunk_blobs(chunks: dict) -> set[str]:
    """Return the blob keys a variant's chunk record names: its chunks and its key list."""
    if not chunks:
        return set()
    return {*chunk_sizes(chunks), chunks["keys"]["ciphertext_sha256"]}


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
    # The encrypted golden data blob (inputs + fp32 reference outputs): see registry/golden.py.
    golden: dict = field(default_factory=dict)
    # The model's chunk secret (contract.chunks), wrapped under the same KEK as data_key.
    chunk_secret: WrappedKey | None = None


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
    golden: dict = field(default_factory=dict)
    # The model's chunk secret, wrapped under data_key's KEK (None before chunks).
    chunk_secret: WrappedKey | None = None

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
class WrappedKey:
    """A data key encrypted under the KEK named by `kek_id`, as the store keeps it.

    Declared here, not beside the KEKs that make it: the store keeps what crypto hands
    it and depends on nothing above it (crypto.kek returns and takes this record).
    """

    kek_id: str
    ciphertext: bytes = field(repr=False)


@dataclass(frozen=True)
class KekState:
    """Which KEK wraps new data keys, shared by every replica, and the other KEKs in use.

    `keyring` lists the URLs of every other KEK a stored data key may be wrapped under
    (previous ones, and one a rotation is moving to). URLs name keys; they hold no secret.
    """

    active_kek_id: str
    active_url: str
    keyring: tuple[str, ...]


@dataclass(frozen=True)
class StoredDataKey:
    """One version's wrapped data key as a KEK rotation reads it."""

    row_id: int
    uid: str
    data_key: WrappedKey
    # The version's copy of its model's chunk secret, under the same KEK (or None).
    chunk_secret: WrappedKey | None = None


class StaleKek(errors.FailedPrecondition):
    """A new version's data key is wrapped under a KEK that is no longer the active one."""


# Builds the version to insert once its number is allocated (the signed manifest names
# the number, so it can only be made inside the allocating transaction).
VersionBuilder = Callable[[int], NewVersion]


class RegistryStore(abc.ABC):
    """Persistent state of the model registry."""

    @abc.abstractmethod
    def create_version(self, model: str, build: VersionBuilder) -> VersionRecord:
        """Create the model if needed and append the next version number (gapless).

        StaleKek when the version's data key is not wrapped under the active KEK (see
        `kek_state`): checked in the inserting transaction, so no version can land under
        a KEK that a rotation has already retired.
        """

    @abc.abstractmethod
    def list_models(self, *, after: str = "", limit: int | None = None) -> list[ModelRecord]:
        """Return models that have at least one version, by name (keyset pages).

        Only names after `after`, at most `limit` of them (None: every one).
        """

    @abc.abstractmethod
    def published_variants(self) -> frozenset[tuple[str, int, str]]:
        """Return every (model, version number, variant) published, in one read."""

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
    def kek_state(self) -> KekState | None:
        """Return the shared KEK state; None before any server recorded one."""

    @abc.abstractmethod
    def init_kek_state(self, state: KekState) -> KekState:
        """Record `state` unless one exists; return the state now stored."""

    @abc.abstractmethod
    def add_to_keyring(self, url: str) -> KekState:
        """Add a KEK URL to the keyring (a no-op for the active one or one already in it)."""

    @abc.abstractmethod
    def data_keys_not_under(self, kek_id: str, *, after: int, limit: int) -> list[StoredDataKey]:
        """Return up to `limit` data keys not wrapped under `kek_id`, by row id past `after`."""

    @abc.abstractmethod
    def replace_data_keys(
        self, moves: Sequence[tuple[StoredDataKey, WrappedKey, WrappedKey | None]]
    ) -> int:
        """Store re-wrapped data keys in one short transaction; returns how many changed.

        A row is only changed while it still holds the wrapped key that was read.
        """

    @abc.abstractmethod
    def activate_kek(self, kek_id: str, url: str) -> int:
        """Make `kek_id` the active KEK if no data key is wrapped under another one.

        Returns how many data keys are still under another KEK (0: it is active now; the
        previous active KEK joins the keyring).
        """

    @abc.abstractmethod
    def kek_rotation_lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold the one KEK-rotation lock of this database, for every process using it.

        FailedPrecondition at once if another rotation holds it. The lock dies with its
        holder, so a rotation killed halfway never blocks the next one.
        """

    @abc.abstractmethod
    def check(self) -> None:
        """Probe the database; Unavailable when it cannot be reached."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections."""
