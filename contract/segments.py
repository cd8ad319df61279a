"""Per-segment SHA-256 digests of an artifact's ciphertext, signed into its manifest.

The ciphertext is cut into `SEGMENT_SIZE` segments (Tink's streaming segments: every
one is exactly that long but the last). At push the registry hashes each segment as it
streams into the blob store; the manifest signs the digests, concatenated and base64'd.
A device checks every segment against them as it arrives, keeps only segments that
match, and after a crash or a cut resumes at the first segment it does not hold
verified: a flipped byte costs one segment, never the download, and nothing unverified
is ever written to its disk.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Iterable, Iterator

from contract import errors

SEGMENT_SIZE = 1 << 20
"""Ciphertext segment size in bytes (header and tag included): `contract.envelope`'s.

Defined here, where nothing imports Tink: a device needs it to check a download, long
before it decrypts anything (an idle agent holds no Tink)."""
DIGEST = 32

__all__ = ["SegmentChecker", "SegmentHasher", "decode_digests", "encode_digests", "segment_count"]


def segment_count(size: int) -> int:
    """Return how many segments a ciphertext of `size` bytes has (at least one)."""
    return max(1, -(-size // SEGMENT_SIZE))


def encode_digests(digests: bytes) -> str:
    """Return concatenated digests as the manifest carries them."""
    return base64.b64encode(digests).decode()


def decode_digests(text: object, size: int) -> bytes:
    """Return the digests a manifest names for a `size`-byte ciphertext; IntegrityError if not."""
    try:
        raw = base64.b64decode(str(text), validate=True)
    except (binascii.Error, ValueError):
        raise errors.IntegrityError("segment digests are not base64") from None
    if len(raw) != DIGEST * segment_count(size):
        raise errors.IntegrityError(
            f"{len(raw) // DIGEST} segment digests for a {size}-byte artifact "
            f"({segment_count(size)} segments)"
        )
    return raw


class SegmentHasher:
    """Hash each segment of a stream as it passes through `wrap`."""

    def __init__(self) -> None:
        self._digests = bytearray()
        self._current = hashlib.sha256()
        self._filled = 0

    def wrap(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """Yield `chunks` unchanged, hashing them; `digests()` is complete once exhausted."""
        for chunk in chunks:
            view = memoryview(chunk)
            while view:
                take = min(len(view), SEGMENT_SIZE - self._filled)
                self._current.update(view[:take])
                self._filled += take
                view = view[take:]
                if self._filled == SEGMENT_SIZE:
                    self._close_segment()
            yield chunk
        if self._filled or not self._digests:
            self._close_segment()

    def _close_segment(self) -> None:
        self._digests += self._current.digest()
        self._current, self._filled = hashlib.sha256(), 0

    def digests(self) -> bytes:
        """Return the digests of every segment, concatenated."""
        return bytes(self._digests)


class SegmentChecker:
    """Check a download segment by segment against signed digests.

    `feed` returns the bytes of the segments completed and verified so far (only those
    may be written); a segment that does not match raises IntegrityError naming it.
    """

    def __init__(self, digests: bytes, size: int, start: int = 0) -> None:
        self._digests, self._size = digests, size
        self._index = start
        self._buffer = bytearray()

    @property
    def verified_bytes(self) -> int:
        """Bytes of the artifact verified so far (whole segments from the start)."""
        return self._index * SEGMENT_SIZE

    def restart(self) -> None:
        """Forget the segment being received: it is fetched again from its start."""
        self._buffer.clear()

    def feed(self, data: bytes) -> bytes:
        """Take downloaded bytes; return the verified whole segments they complete."""
        self._buffer += data
        done = bytearray()
        while len(self._buffer) >= SEGMENT_SIZE:
            self._check(self._buffer[:SEGMENT_SIZE])
            done += self._buffer[:SEGMENT_SIZE]
            del self._buffer[:SEGMENT_SIZE]
        return bytes(done)

    def finish(self) -> bytes:
        """Verify what is left (the last, shorter segment) once the download has ended."""
        tail = bytes(self._buffer)
        if tail or self._index < segment_count(self._size):
            self._check(tail)
        self._buffer.clear()
        if self._index != segment_count(self._size):
            raise errors.IntegrityError(
                f"download ended after segment {self._index} of {segment_count(self._size)}"
            )
        return tail

    def _check(self, segment: bytes | bytearray) -> None:
        i = self._index
        expected = self._digests[i * DIGEST : (i + 1) * DIGEST]
        if hashlib.sha256(segment).digest() != expected:
            raise errors.IntegrityError(f"segment {i} does not match its signed digest")
        self._index += 1


def verified_prefix(path, digests: bytes, size: int) -> int:
    """Return how many leading bytes of a partial download at `path` verify (whole segments).

    A fully verified file returns `size`.
    """
    verified = 0
    try:
        with open(path, "rb") as f:
            for i in range(segment_count(size)):
                segment = f.read(SEGMENT_SIZE)
                if not segment:
                    break
                if hashlib.sha256(segment).digest() != digests[i * DIGEST : (i + 1) * DIGEST]:
                    break
                if len(segment) < SEGMENT_SIZE and verified + len(segment) != size:
                    break  # a cut segment, not the last one
                verified += len(segment)
    except FileNotFoundError:
        return 0
    return verified
