"""Content-defined chunks of a model version, encrypted so that one model's versions share them.

A version's files are cut into content-defined chunks at push
(`control_plane.registry.chunking`); a chunk that is the same plaintext in two versions
of one model is stored once and a device that holds it never downloads it again. Each
chunk is encrypted on its own, deterministically within its model:

    S     per-model secret: 32 random bytes, made at the model's first chunked push and
          held only by the control plane (wrapped under its KEK, as data keys are)
    K(P)  = HKDF-SHA256(ikm=S, salt=model uid, info=INFO || SHA-256(P)), 64 bytes
    C     = AES-SIV(K(P)).encrypt(P, associated data: DOMAIN, model uid)   (RFC 5297)
    id    = SHA-256(C), signed in the version's manifest with P's size

The same plaintext in the same model gives the same K, so the same C and id: stored
once, fetched once. Another model has another S, so the same plaintext there is an
unrelated ciphertext with an unrelated id. Without S nobody can compute K for a guessed
plaintext, so the blob store cannot confirm a guess by recomputing its ciphertext (the
weakness of plain convergent encryption, where the key is the plaintext's hash). Chunk
boundaries are keyed by S too (`boundary_relabel`), so chunk lengths neither confirm a
guessed model nor link two models holding the same content (README, "Chunked updates"). A device
receives the keys of the chunks of the versions it is assigned, in a list encrypted under
that version's data key (itself wrapped to the device): a key opens one chunk, and says
nothing of the keys of chunks it does not hold. AES-SIV is a deterministic AEAD (a
synthetic IV from the key, data and plaintext): every chunk is authenticated, and each
key encrypts one plaintext only.

This module is the device side's half as well: `open_chunk` checks a chunk against its
signed id before it decrypts it, then authenticates it under its key and model.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESSIV
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from contract import errors

SCHEME = "skiff-chunks/v1"
SECRET_SIZE = 32
KEY_SIZE = 64  # AES-256-SIV: two 256-bit keys
ID_SIZE = 32
TAG_SIZE = 16  # the synthetic IV that prefixes every AES-SIV ciphertext
# No chunk is bigger than this (the cutter's maximum is far below it): a device buffers
# one chunk in memory, so a manifest naming a bigger one is refused before anything runs.
MAX_CHUNK = 16 << 20
# Chunks one DownloadChunks call may ask for: a call's pieces are read and sent one at a
# time, so this bounds the call's length, not the memory it holds.
MAX_CHUNKS_PER_CALL = 64

_INFO = b"skiff-chunk-key/v1"
_BOUNDARY_INFO = b"skiff-chunk-boundaries/v1"
_DOMAIN = b"skiff-chunk/v1"

__all__ = [
    "ChunkRef",
    "ChunkTable",
    "boundary_relabel",
    "chunk_id",
    "chunk_key",
    "new_secret",
    "open_chunk",
    "pack_keys",
    "seal_chunk",
    "unpack_keys",
]


def new_secret() -> bytes:
    """Return a fresh per-model chunk secret (control plane only)."""
    import secrets

    return secrets.token_bytes(SECRET_SIZE)


def boundary_relabel(secret: bytes, model: str) -> bytes:
    """Return the model's secret byte relabelling for chunk boundaries (control plane only).

    FastCDC's gear table is public, so unkeyed boundaries, and so chunk lengths, are a
    function of the content alone: whoever sees stored sizes could cut a guessed model
    and compare. Boundaries are found on the content with each byte value relabelled by
    a permutation only S determines (the 256 values sorted by HMAC under a key derived
    from S): within the model the same content still cuts the same way and an edit still
    moves only the boundaries near it; without S they cannot be predicted.
    """
    if len(secret) != SECRET_SIZE:
        raise errors.InvalidArgument(f"a chunk secret is {SECRET_SIZE} bytes, got {len(secret)}")
    key = HKDF(hashes.SHA256(), 32, salt=model.encode(), info=_BOUNDARY_INFO).derive(secret)
    return bytes(sorted(range(256), key=lambda b: hmac.new(key, bytes((b,)), "sha256").digest()))


def chunk_key(secret: bytes, model_uid: str, plaintext: bytes | memoryview) -> bytes:
    """Return the key of a chunk of `model_uid` holding `plaintext` (control plane only)."""
    if len(secret) != SECRET_SIZE:
        raise errors.InvalidArgument(f"a chunk secret is {SECRET_SIZE} bytes, got {len(secret)}")
    info = _INFO + hashlib.sha256(plaintext).digest()
    return HKDF(hashes.SHA256(), KEY_SIZE, salt=model_uid.encode(), info=info).derive(secret)


def seal_chunk(key: bytes, model_uid: str, plaintext: bytes | memoryview) -> bytes:
    """Return a chunk's ciphertext (deterministic: the same key and plaintext, the same bytes)."""
    return AESSIV(key).encrypt(bytes(plaintext), [_DOMAIN, model_uid.encode()])


def open_chunk(key: bytes, model_uid: str, chunk_id: bytes, ciphertext: bytes) -> bytes:
    """Return a chunk's plaintext once it matches its signed id and authenticates.

    IntegrityError naming the chunk when it was altered, replaced (by another model's
    chunk of the same length, say) or opened with the wrong key.
    """
    name = chunk_id.hex()[:12]
    if hashlib.sha256(ciphertext).digest() != chunk_id:
        raise errors.IntegrityError(f"chunk {name} does not match its signed digest")
    if len(key) != KEY_SIZE:
        raise errors.IntegrityError(f"chunk {name}: its key is not {KEY_SIZE} bytes")
    try:
        return AESSIV(key).decrypt(ciphertext, [_DOMAIN, model_uid.encode()])
    except InvalidTag:
        raise errors.IntegrityError(
            f"chunk {name} failed authentication (wrong key, model or content)"
        ) from None


def chunk_id(ciphertext: bytes) -> bytes:
    """Return the id of a chunk ciphertext (its SHA-256)."""
    return hashlib.sha256(ciphertext).digest()


@dataclass(frozen=True)
class ChunkRef:
    """One chunk of a file, in order: its id and its plaintext size."""

    id: bytes
    size: int

    @property
    def ciphertext_size(self) -> int:
        """Bytes a device downloads and keeps for it."""
        return self.size + TAG_SIZE


@dataclass(frozen=True)
class ChunkTable:
    """A variant's plaintext as a sequence of chunks, as its signed manifest lists them."""

    chunks: tuple[ChunkRef, ...]

    @property
    def plaintext_size(self) -> int:
        """The size of the plaintext the chunks make, in order."""
        return sum(c.size for c in self.chunks)

    def distinct(self) -> dict[bytes, ChunkRef]:
        """Return each chunk once (a table may name a chunk twice: a repeated stretch)."""
        return {c.id: c for c in self.chunks}

    def to_manifest(self) -> dict:
        """Return the table as the manifest carries it."""
        return {
            "scheme": SCHEME,
            "ids": base64.b64encode(b"".join(c.id for c in self.chunks)).decode(),
            "sizes": [c.size for c in self.chunks],
        }

    @classmethod
    def from_manifest(cls, doc: object, plaintext_size: int) -> ChunkTable:
        """Return the table a signed manifest names; IntegrityError if it is malformed.

        The sizes must add up to the variant's signed plaintext size, each within
        (0, MAX_CHUNK] (an empty plaintext is one empty chunk).
        """
        if not isinstance(doc, dict) or doc.get("scheme") != SCHEME:
            raise errors.IntegrityError(f"the chunk table is not {SCHEME}")
        try:
            ids = base64.b64decode(str(doc.get("ids", "")), validate=True)
        except (binascii.Error, ValueError):
            raise errors.IntegrityError("the chunk table's ids are not base64") from None
        sizes = doc.get("sizes")
        if not isinstance(sizes, list) or len(ids) != ID_SIZE * len(sizes) or not sizes:
            raise errors.IntegrityError("the chunk table's ids and sizes do not match")
        if any(type(s) is not int or not 0 <= s <= MAX_CHUNK for s in sizes):
            raise errors.IntegrityError(f"a chunk's size is not in 0..{MAX_CHUNK}")
        if sum(sizes) != plaintext_size or (0 in sizes and len(sizes) > 1):
            raise errors.IntegrityError(
                f"the chunks make {sum(sizes)} bytes, the variant has {plaintext_size}"
            )
        return cls(
            tuple(ChunkRef(ids[i * ID_SIZE : (i + 1) * ID_SIZE], s) for i, s in enumerate(sizes))
        )

    def missing_from(self, held: Iterable[bytes]) -> list[ChunkRef]:
        """Return the distinct chunks not in `held`, in table order (what to download)."""
        have = set(held)
        return [c for c in self.distinct().values() if c.id not in have]


def pack_keys(keys: Sequence[bytes]) -> bytes:
    """Return a version's chunk keys, one per table entry, as one plaintext to encrypt."""
    if any(len(k) != KEY_SIZE for k in keys):
        raise errors.InvalidArgument(f"a chunk key is {KEY_SIZE} bytes")
    return b"".join(keys)


def unpack_keys(packed: bytes, table: ChunkTable) -> dict[bytes, bytes]:
    """Return each chunk's key by id; IntegrityError when the list does not fit the table."""
    if len(packed) != KEY_SIZE * len(table.chunks):
        raise errors.IntegrityError(
            f"{len(packed) // KEY_SIZE} chunk keys for {len(table.chunks)} chunks"
        )
    keys: dict[bytes, bytes] = {}
    for i, ref in enumerate(table.chunks):
        key = packed[i * KEY_SIZE : (i + 1) * KEY_SIZE]
        if keys.setdefault(ref.id, key) != key:
            raise errors.IntegrityError(f"chunk {ref.id.hex()[:12]} is listed with two keys")
    return keys
