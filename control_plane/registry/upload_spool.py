"""Anonymous in-memory files: where plaintext models live on the server.

A memfd is RAM-backed and never touches a filesystem, yet MNN (which only loads from a
path) can open it as /proc/<pid>/fd/N. Its pages are not part of the process's RSS unless
mapped, so spooling a large upload here does not inflate the server's resident set.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from contract import errors
from control_plane.files import write_all

CHUNK = 1 << 20


@dataclass(frozen=True)
class Spooled:
    """A memfd holding a stream's bytes, with their size and SHA-256."""

    fd: int
    size: int
    sha256: str


def spool(chunks: Iterable[bytes], *, limit: int, name: str = "skiff-model") -> Spooled:
    """Copy a stream into a new memfd while hashing; TooLarge as soon as it passes `limit`.

    The caller owns the returned fd. On any error the memfd is closed and the error
    propagates, so a cut-off or oversized upload leaves nothing behind.
    """
    spooler = Spooler(limit=limit, name=name)
    try:
        for chunk in chunks:
            spooler.write(chunk)
        return spooler.finish()
    except BaseException:
        spooler.discard()
        raise


class Spooler:
    """`spool` one chunk at a time, for callers that receive chunks asynchronously."""

    def __init__(self, *, limit: int, name: str = "skiff-model") -> None:
        self._limit = limit
        self._digest, self._size = hashlib.sha256(), 0
        self._fd: int | None = os.memfd_create(name, os.MFD_CLOEXEC)

    def write(self, chunk: bytes) -> None:
        """Append and hash `chunk`; TooLarge (nothing written) once past the limit."""
        self._size += len(chunk)
        if self._size > self._limit:
            raise errors.TooLarge(f"model is larger than the {_human(self._limit)} limit")
        self._digest.update(chunk)
        write_all(self._live_fd(), chunk)

    def finish(self) -> Spooled:
        """Hand over the memfd (the caller now owns it) with its size and digest."""
        spooled = Spooled(fd=self._live_fd(), size=self._size, sha256=self._digest.hexdigest())
        self._fd = None
        return spooled

    def discard(self) -> None:
        """Close the memfd unless `finish` handed it over; safe to call twice."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _live_fd(self) -> int:
        if self._fd is None:
            raise ValueError("spooler already finished or discarded")
        return self._fd


def read_chunks(fd: int, *, chunk: int = CHUNK) -> Iterator[bytes]:
    """Yield the fd's bytes from the start, without moving its offset."""
    offset = 0
    while data := os.pread(fd, chunk, offset):
        offset += len(data)
        yield data


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
