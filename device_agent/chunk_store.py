"""The agent's chunk store: the chunks of kept versions, named by id, encrypted at rest.

`chunks/ID` holds a chunk exactly as the blob store does: its AES-SIV ciphertext under
its content key (`contract.chunks`). The keys are never on the disk in the clear: they
travel in each version's key list, encrypted under the version's data key, itself wrapped
to this device. An install fetches only the chunks of its version's signed table that
are not here, each checked against its id as it arrives and written beside its final
name, fsynced, renamed and the directory fsynced: a power cut leaves a chunk whole or
absent (a leftover `.part` goes at the next sweep, unless its chunk is still wanted: then
its next write replaces it). Every read is checked again, so a
chunk damaged on the disk is refused, deleted and fetched again by the next install.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import hashlib
import logging
import os
import shutil
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from contract import chunks, errors
from contract.device_client import DeviceCallError, DeviceConnection
from device_agent.download import DISK_MARGIN_BYTES, DiskFull, IntegrityFailure
from device_agent.state import fsync_dir, write_all

log = logging.getLogger("skiff.agent")

_PART = ".part"
# Chunks asked for in one DownloadChunks call, and calls at once: one call's round trip
# (and the control plane's check of the assignment, once a call) overlaps the others'
# transfer, with as many calls as ever before and a fraction of the checks. Every chunk
# of the calls in flight has its room in the write backlog.
CHUNKS_PER_CALL, IN_FLIGHT = 8, 4
# Threads writing (and fsyncing) fetched chunks, and how many chunks may be held in
# memory at once waiting for theirs, those being downloaded included (room is taken
# before a download): at most 32 chunks of at most 4x the average chunk size. A call
# takes room for all of its chunks first, so CHUNKS_PER_CALL must not exceed it.
WRITERS, WRITE_BACKLOG = 2, 32
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
        self._store(chunk_id, ciphertext, sync_dir=sync_dir)

    def _store(self, chunk_id: bytes, ciphertext: bytes, *, sync_dir: bool = False) -> None:
        """Write a chunk already checked against its id: beside its name, fsynced, renamed."""
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
        self,
        table: chunks.ChunkTable,
        keys: dict[bytes, bytes],
        model: str,
        opened: OpenedChunks | None = None,
    ) -> Iterator[bytes]:
        """Yield a version's plaintext chunk by chunk, each checked and authenticated.

        A chunk in `opened` (opened as it was fetched) is taken from there, the others
        are read from the store.
        """
        # A chunk the table names twice stays in `opened` until its last use.
        uses = collections.Counter(ref.id for ref in table.chunks)
        for ref in table.chunks:
            plain = None
            if opened is not None:
                uses[ref.id] -= 1
                plain = opened.take(ref.id, last=not uses[ref.id])
            if plain is None:
                try:
                    plain = chunks.open_chunk(keys[ref.id], model, ref.id, self.read(ref.id))
                except errors.IntegrityError as exc:
                    self.path(ref.id).unlink(missing_ok=True)
                    raise IntegrityFailure(str(exc)) from None
            if len(plain) != ref.size:
                raise IntegrityFailure(f"chunk {ref.id.hex()[:12]} is not {ref.size} bytes")
            yield plain

    async def fetch_missing(
        self, conn: DeviceConnection, table: chunks.ChunkTable, opened: OpenedChunks | None = None
    ) -> ChunkWrites:
        """Download the chunks of `table` not held here, check them, and keep them.

        Each chunk is checked against its signed id before it is kept; a chunk that does
        not match is not kept and fails the install (IntegrityFailure): the chunks already
        kept stay, so the next attempt fetches only what is still missing. With `opened`,
        each is also authenticated and decrypted into it as it arrives (in memory only),
        so the self-test that follows neither reads it back nor hashes it again.

        Returns once every chunk is checked (and opened). Their writes (each written beside
        its name, fsynced, renamed) go on behind the download, in threads of their own, so
        no fsync holds up a transfer or the self-test: await the result's `kept()` before
        anything names them.
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
        writes = ChunkWrites(self._store, self._root, len(missing))
        slots, taking = asyncio.Semaphore(IN_FLIGHT), asyncio.Lock()

        async def call(refs: list[chunks.ChunkRef]) -> None:
            taken = handed = 0  # rooms taken, and handed on to writes (which free them)
            checks: list[asyncio.Future] = []

            async def keep(ref: chunks.ChunkRef, data: bytes) -> None:
                nonlocal handed
                # The check (and the opening) in a thread, off the loop receiving the rest.
                await asyncio.to_thread(_check, ref, data, opened)
                writes.write(ref.id, data)
                handed += 1

            try:
                # Room first, for every chunk of the call: a chunk downloaded but not yet
                # written holds it, so a disk slower than the network holds the download
                # back, not the chunks in memory. One call takes its rooms at a time: calls
                # that each held part of theirs would wait on each other for ever.
                async with taking:
                    for _ in refs:
                        await writes.room()
                        taken += 1
                async with slots:
                    writes.raise_failed()  # a full disk stops the download
                    async with contextlib.aclosing(self._download(conn, refs)) as fetched:
                        async for ref, data in fetched:
                            checks.append(asyncio.ensure_future(keep(ref, data)))
                await asyncio.gather(*checks)
            except BaseException:
                for task in checks:
                    task.cancel()
                await asyncio.gather(*checks, return_exceptions=True)
                for _ in range(taken - handed):
                    writes.give_back_room()
                raise

        tasks = [
            asyncio.ensure_future(call(missing[i : i + CHUNKS_PER_CALL]))
            for i in range(0, len(missing), CHUNKS_PER_CALL)
        ]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # the first failure stops the rest
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(Exception):
                await writes.kept()  # what was checked stays: the next attempt skips it
            raise
        return writes

    async def _download(
        self, conn: DeviceConnection, refs: list[chunks.ChunkRef]
    ) -> AsyncIterator[tuple[chunks.ChunkRef, bytes]]:
        """Yield each chunk of `refs` with its ciphertext as fetched (not yet checked)."""
        came = 0  # chunks come in the order asked: refs[came] is the one on its way
        try:
            async for _, data in conn.download_chunks(
                [(ref.id.hex(), ref.ciphertext_size) for ref in refs]
            ):
                came += 1
                yield refs[came - 1], data
        except DeviceCallError as exc:
            if exc.code not in _THIS_VERSIONS_FAULT:
                raise  # the network or the server: the sync is tried again
            # The control plane lacks the chunk (or no longer assigns it): this version
            # fails to install, the other models of the sync go on.
            # Every chunk of the call may have come whole before the call failed.
            which = refs[came] if came < len(refs) else refs[-1]
            raise IntegrityFailure(
                f"chunk {which.id.hex()[:12]} could not be fetched: {exc}"
            ) from None

    def sweep(self, keep: Iterable[bytes]) -> int:
        """Delete every chunk not in `keep`, and partial writes of others; return how many.

        The partial write of a chunk in `keep` may be in progress (an install's writes go
        on in threads): it stays, and a later write of that chunk replaces a leftover.
        """
        wanted = {k.hex() for k in keep}
        removed = 0
        if not self._root.is_dir():
            return 0
        for entry in os.scandir(self._root):
            name = entry.name.removesuffix(_PART)
            if name in wanted and entry.is_file(follow_symlinks=False):
                continue
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)  # nothing the agent made
            else:
                Path(entry.path).unlink(missing_ok=True)
            removed += 1
        if removed:
            fsync_dir(self._root)
        return removed


def _check(ref: chunks.ChunkRef, ciphertext: bytes, opened: OpenedChunks | None) -> None:
    """Check a fetched chunk against its id; with `opened`, open it (which checks that too)."""
    if opened is not None:
        opened.open(ref.id, ciphertext)  # IntegrityFailure unless it matches and authenticates
    elif hashlib.sha256(ciphertext).digest() != ref.id:
        raise IntegrityFailure(f"chunk {ref.id.hex()[:12]} does not match its signed digest")


class ChunkWrites:
    """The writes of the chunks one fetch checked, in WRITERS threads of their own.

    At most WRITE_BACKLOG chunks wait for theirs (the download waits for room): memory
    stays bounded where the disk is slower than the network.
    """

    def __init__(self, store: Callable[[bytes, bytes], None], root: Path, count: int) -> None:
        self.count, self.bytes = count, 0
        self._store, self._root = store, root
        self._writer = ThreadPoolExecutor(WRITERS, "skiff-chunk-write") if count else None
        self._pending: list[asyncio.Future] = []
        self._room = asyncio.Semaphore(WRITE_BACKLOG)
        self._done = False
        self._failed: BaseException | None = None  # the first write that failed

    async def room(self) -> None:
        """Wait until one more checked chunk may wait for its write."""
        await self._room.acquire()

    def give_back_room(self) -> None:
        """Return the room taken for a chunk that failed its check."""
        self._room.release()

    def write(self, chunk_id: bytes, ciphertext: bytes) -> None:
        """Start writing a checked chunk (in the room taken for it)."""
        assert self._writer is not None
        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._writer, self._store, chunk_id, ciphertext)
        future.add_done_callback(self._written)
        self._pending.append(future)
        self.bytes += len(ciphertext)

    def _written(self, future: asyncio.Future) -> None:
        self._room.release()
        # Every write's error is retrieved here (asyncio logs one never retrieved); the
        # first is kept to stop the download and fail the install.
        error = None if future.cancelled() else future.exception()
        if error is not None and self._failed is None:
            self._failed = error

    def raise_failed(self) -> None:
        """Raise the error of a write that failed (DiskFull, say), if one did."""
        if self._failed is not None:
            raise self._failed

    async def kept(self) -> None:
        """Wait until every chunk is written, fsynced and renamed, and the directory fsynced.

        Raises the first write's error (DiskFull, OSError); the chunks written stay.
        """
        if self._pending:
            await asyncio.wait(self._pending)
        if not self._done and self._writer is not None:
            self._done = True
            self._writer.shutdown(wait=False)
            await asyncio.to_thread(fsync_dir, self._root)  # every rename at once
        self.raise_failed()


class OpenedChunks:
    """The plaintext of the chunks one install fetched, opened as each arrived.

    In memory only, for the self-test that follows the download. A chunk is opened by
    `contract.chunks.open_chunk`: checked against its signed id, then authenticated
    under its key and model, before any of its plaintext is kept. The version's whole
    plaintext is still checked against its signed digest as it is read (Plaintext).
    """

    def __init__(self, keys: dict[bytes, bytes], model: str) -> None:
        self._keys, self._model = keys, model
        self._plain: dict[bytes, bytes] = {}

    def open(self, chunk_id: bytes, ciphertext: bytes) -> None:
        """Open a fetched chunk and keep its plaintext; IntegrityFailure if it does not open."""
        key = self._keys.get(chunk_id)
        if key is None:
            raise IntegrityFailure(f"chunk {chunk_id.hex()[:12]} has no key")
        try:
            self._plain[chunk_id] = chunks.open_chunk(key, self._model, chunk_id, ciphertext)
        except errors.IntegrityError as exc:
            raise IntegrityFailure(str(exc)) from None

    def take(self, chunk_id: bytes, *, last: bool) -> bytes | None:
        """Return a chunk's plaintext if it was opened here (dropped from here if `last`)."""
        return self._plain.pop(chunk_id, None) if last else self._plain.get(chunk_id)
