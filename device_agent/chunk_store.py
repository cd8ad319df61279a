"""The agent's chunk store: the chunks of kept versions, named by id, encrypted at rest.

`chunks/ID` holds a chunk exactly as the blob store does: its AES-SIV ciphertext under
its content key (`contract.chunks`). The keys are never on the disk in the clear: they
travel in each version's key list, encrypted under the version's data key, itself wrapped
to this device. An install fetches only the chunks of its version's signed table that
are not here, each checked against its id as it arrives and written beside its final
name, fsynced, renamed and the directory fsynced: a power cut leaves a chunk whole or
absent (a leftover `.part` goes at the next sweep). Every read is checked again, so a
chunk damaged on the disk is refused, deleted and fetched again by the next install.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc

from contract import chunks, errors
from contract.device_client import DeviceCallError, DeviceConnection
from device_agent.download import DISK_MARGIN_BYTES, DiskFull, IntegrityFailure
from device_agent.state import fsync_dir, write_all

log = logging.getLogger("skiff.agent")

_PART = ".part"
IN_FLIGHT = 4  # chunk downloads at once
# Answers that are about this version's chunk, not the connection: the install fails.
_THIS_VERSIONS_FAULT = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.DATA_LOSS,
)


class ChunkStore:
    """The chunks directory of a state directory."""

    def __init__(self, root: Path) -> None:
        self._root = root

    def path(self, chunk_id: bytes) -> Path:
        """Return where the chunk with this id is kept."""
        if len(chunk_id) != chunks.ID_SIZE:
            raise IntegrityFailure(f"chunk id {chunk_id.hex()!r} is not a SHA-256")
        return self._root / chunk_id.hex()

    def held(self) -> set[bytes]:
        """Return the ids of the chunks here."""
        found: set[bytes] = set()
        if not self._root.is_dir():  # a state directory made before chunks: none yet
            return found
        for entry in os.scandir(self._root):
            name = entry.name
            if len(name) == 2 * chunks.ID_SIZE and entry.is_file(follow_symlinks=False):
                try:
                    found.add(bytes.fromhex(name))
                except ValueError:
                    continue
        return found

    def put(self, chunk_id: bytes, ciphertext: bytes, *, sync_dir: bool = True) -> None:
        """Keep a chunk that matches its id (IntegrityFailure if not): whole or not at all.

        `sync_dir=False` leaves the directory's fsync to the caller (one for a batch): a
        chunk whose rename a power cut undid is simply fetched again, and one that
        survived with bad bytes fails its id when read.
        """
        if hashlib.sha256(ciphertext).digest() != chunk_id:
            raise IntegrityFailure(f"chunk {chunk_id.hex()[:12]} does not match its signed digest")
        final = self.path(chunk_id)
        part = final.with_name(final.name + _PART)
        try:
            self._root.mkdir(mode=0o700, exist_ok=True)
            part.unlink(missing_ok=True)  # a leftover (or planted) entry is not written through
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(part, flags, 0o600)
            try:
                write_all(fd, ciphertext)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(part, final)
            if sync_dir:
                fsync_dir(self._root)
        except OSError as exc:
            part.unlink(missing_ok=True)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"disk full while storing chunk {chunk_id.hex()[:12]}") from None
            raise

    def read(self, chunk_id: bytes) -> bytes:
        """Return a held chunk's ciphertext, checked against its id.

        A chunk that no longer matches (the disk damaged it) is deleted and refused:
        IntegrityFailure, and the next install fetches it again.
        """
        path = self.path(chunk_id)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:  # absent, or not a regular file (a directory, a link)
            raise IntegrityFailure(f"chunk {chunk_id.hex()[:12]} is missing") from None
        with os.fdopen(fd, "rb") as f:
            data = f.read(chunks.MAX_CHUNK + chunks.TAG_SIZE + 1)
        if hashlib.sha256(data).digest() != chunk_id:
            path.unlink(missing_ok=True)
            raise IntegrityFailure(f"chunk {chunk_id.hex()[:12]} was damaged on the disk")
        return data

    def plaintext(
        self, table: chunks.ChunkTable, keys: dict[bytes, bytes], model: str
    ) -> Iterator[bytes]:
        """Yield a version's plaintext chunk by chunk, each checked and authenticated."""
        for ref in table.chunks:
            try:
                plain = chunks.open_chunk(keys[ref.id], model, ref.id, self.read(ref.id))
            except errors.IntegrityError as exc:
                self.path(ref.id).unlink(missing_ok=True)
                raise IntegrityFailure(str(exc)) from None
            if len(plain) != ref.size:
                raise IntegrityFailure(f"chunk {ref.id.hex()[:12]} is not {ref.size} bytes")
            yield plain

    async def fetch_missing(
        self, conn: DeviceConnection, table: chunks.ChunkTable
    ) -> tuple[int, int]:
        """Download the chunks of `table` not held here; return (chunks, bytes) fetched.

        Each chunk is checked against its signed id before it is kept; a chunk that does
        not match is not kept and fails the install (IntegrityFailure): the chunks already
        kept stay, so the next attempt fetches only what is still missing.
        """
        missing = table.missing_from(self.held())
        need = sum(c.ciphertext_size for c in missing)
        self._root.mkdir(mode=0o700, exist_ok=True)
        free = shutil.disk_usage(self._root).free
        if missing and free < need + DISK_MARGIN_BYTES:
            raise DiskFull(
                f"not enough disk space for {len(missing)} chunks ({need} bytes) in "
                f"{self._root}: {free} bytes free"
            )
        # A few downloads in flight at once: one chunk's round trip (and the control
        # plane's check of the assignment) overlaps the others' transfer.
        slots, fetched = asyncio.Semaphore(IN_FLIGHT), [0]

        async def one(ref: chunks.ChunkRef) -> None:
            async with slots:
                data = await self._download(conn, ref)
                self.put(ref.id, data, sync_dir=False)
                fetched[0] += len(data)

        tasks = [asyncio.ensure_future(one(ref)) for ref in missing]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:  # the first failure stops the rest
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if missing:
                fsync_dir(self._root)  # every rename of the batch made durable at once
        return len(missing), fetched[0]

    async def _download(self, conn: DeviceConnection, ref: chunks.ChunkRef) -> bytes:
        pieces: list[bytes] = []
        size = 0
        try:
            async for _, piece in conn.download(ref.id.hex(), size=ref.ciphertext_size, offset=0):
                pieces.append(piece)
                size += len(piece)
                if size > ref.ciphertext_size:
                    break
        except DeviceCallError as exc:
            if exc.code not in _THIS_VERSIONS_FAULT:
                raise  # the network or the server: the sync is tried again
            # The control plane lacks the chunk (or no longer assigns it): this version
            # fails to install, the other models of the sync go on.
            raise IntegrityFailure(
                f"chunk {ref.id.hex()[:12]} could not be fetched: {exc}"
            ) from None
        # A chunk is most often one piece: kept as it came, not copied.
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def sweep(self, keep: Iterable[bytes]) -> int:
        """Delete every chunk not in `keep`, and leftover partial writes; return how many."""
        wanted = {k.hex() for k in keep}
        removed = 0
        if not self._root.is_dir():
            return 0
        for entry in os.scandir(self._root):
            if entry.name in wanted and entry.is_file(follow_symlinks=False):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)  # nothing the agent made
            else:
                Path(entry.path).unlink(missing_ok=True)
            removed += 1
        if removed:
            fsync_dir(self._root)
        return removed
