"""The content-addressed blob store interface shared by every backend.

A blob's key is the lowercase hex SHA-256 of its bytes, so a key names exactly one
content and writes are idempotent. Blobs hold encrypted model artifacts; a store never
sees plaintext.
"""

from __future__ import annotations

import abc
import datetime as dt
import hashlib
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from contract.errors import IntegrityError, InvalidArgument, Unavailable

CHUNK_SIZE = 1024 * 1024
"""Bytes per read/write; large enough to amortise syscalls, small enough to stream."""

_KEY_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class BlobInfo:
    """A published blob: its key (hex SHA-256) and size in bytes."""

    key: str
    size: int


@dataclass(frozen=True)
class StoredBlob:
    """A published blob as listed: its key, size, and when the store last wrote it."""

    key: str
    size: int
    # Aware UTC, by the store's own clock (file mtime, S3 LastModified).
    modified: dt.datetime


def check_key(key: object) -> str:
    """Return ``key`` if it is 64 lowercase hex characters, else raise InvalidArgument."""
    if not isinstance(key, str) or not is_key(key):
        raise InvalidArgument(f"invalid blob key {key!r}: expected 64 lowercase hex chars")
    return key


def check_offset(offset: int, size: int, key: str) -> None:
    """Raise InvalidArgument unless ``0 <= offset <= size`` (offset == size reads nothing)."""
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset <= size:
        raise InvalidArgument(f"offset {offset} outside blob {key} of size {size}")


def check_expected(sha256: str | None) -> None:
    """Validate an optional expected digest before any bytes are read."""
    if sha256 is not None:
        check_key(sha256)


def verify_digest(expected: str | None, actual: str) -> None:
    """Raise IntegrityError if an expected digest was given and ``actual`` differs."""
    if expected is not None and expected != actual:
        raise IntegrityError(f"blob digest mismatch: expected {expected}, got {actual}")


def iter_file(f: BinaryIO) -> Iterator[bytes]:
    """Yield an open file's bytes from its current position in CHUNK_SIZE pieces, then close it."""
    with f:
        while chunk := f.read(CHUNK_SIZE):
            yield chunk


def is_key(name: str) -> bool:
    """Return whether ``name`` is a well-formed blob key."""
    return bool(_KEY_RE.fullmatch(name))


def hash_chunks(chunks: Iterable[bytes], out: BinaryIO | None = None) -> BlobInfo:
    """Hash ``chunks`` (also writing them to ``out`` if given) and return their BlobInfo.

    Only failures of ``out`` become Unavailable; whatever the iterator raises
    propagates unchanged so callers see their own errors.
    """
    digest = hashlib.sha256()
    size = 0
    for chunk in chunks:
        digest.update(chunk)
        size += len(chunk)
        if out is None:
            continue
        try:
            out.write(chunk)
        except OSError as exc:
            raise Unavailable(f"cannot write blob temp file: {exc.strerror or exc}") from exc
    return BlobInfo(key=digest.hexdigest(), size=size)


class BlobStore(abc.ABC):
    """A content-addressed store of immutable blobs keyed by their SHA-256."""

    @abc.abstractmethod
    def put_stream(self, chunks: Iterable[bytes], *, refresh: bool = False) -> BlobInfo:
        """Store the concatenated chunks under their SHA-256 (verify-then-rename).

        If the iterator raises, nothing is left behind (no temp files or objects) and
        the exception propagates.
        """

    @abc.abstractmethod
    def open_read(self, key: str, *, offset: int = 0) -> Iterator[bytes]:
        """Return an iterator of chunks from ``offset`` to the end (resumable downloads).

        The blob is opened eagerly, so NotFound is raised by this call rather than by
        the first ``next()``.
        """

    @abc.abstractmethod
    def stat(self, key: str) -> BlobInfo:
        """Return the blob's info; raise NotFound if it is missing."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Return whether the blob is published."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove the blob; a missing key is not an error."""

    @abc.abstractmethod
    def keys(self) -> Iterator[str]:
        """Yield every published key (temp files excluded), in no particular order."""

    @abc.abstractmethod
    def list_blobs(self) -> Iterator[StoredBlob]:
        """Yield every published blob with its size and write time (for garbage collection)."""

    # Whether presigned_url gives URLs (and so may need credentials refreshed over the
    # network, as botocore's do): callers on an event loop ask in a thread then.
    presigns = False

    def presigned_url(self, key: str, *, expires_s: int) -> str | None:
        """Return a short-lived URL that serves the blob's bytes, or None if unsupported.

        Devices then fetch artifacts straight from the store (or a CDN in front of it)
        instead of through the control plane; the bytes are ciphertext either way.
        """
        return None

    def check(self) -> None:
        """Probe reachability cheaply; raise Unavailable if the store cannot be used.

        The default looks up a key that is never written; backends override it with
        a probe that also covers writability or skips the lookup.
        """
        self.exists("0" * 64)
