"""Fetching an artifact onto the device: resumable, verified as it arrives, kept whole.

Artifacts are kept encrypted under `artifacts/SHA256` (named by ciphertext digest) and
downloaded beside it as `SHA256.part`. With the per-segment digests the manifest signs
(contract.segments), every 1 MiB segment is checked as it arrives and only
verified segments are written, so a crash or a cut resumes at the first segment not held
verified and a flipped byte costs one segment. The presigned URL a Sync answer may carry
is tried first (device_agent.url_fetch); the control plane's Download takes over where it
fails or sends a segment that does not verify. The finished file becomes the artifact by
one rename, made durable.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from contract import errors
from contract.device_client import DeviceConnection
from contract.segments import SEGMENT_SIZE, SegmentChecker, verified_prefix
from device_agent.state import AgentError, fsync_dir, write_all
from device_agent.url_fetch import UrlFetchError, fetch_url, usable_url

if TYPE_CHECKING:
    from device_agent.install import InstallTimings

log = logging.getLogger("skiff.agent")

# Free space kept beyond an artifact's size, so a download never fills the disk.
DISK_MARGIN_BYTES = 64 << 20


class IntegrityFailure(AgentError):
    """Downloaded bytes or keys do not match what the signed assignment promises."""


class DiskFull(AgentError):
    """No room for the artifact; the partial download was removed (tried again later)."""


class Downloads:
    """The artifacts directory of a state directory, and how artifacts get into it."""

    def __init__(self, artifacts: Path) -> None:
        self._artifacts = artifacts

    def artifact_path(self, digest: str) -> Path:
        """Return where the artifact with this ciphertext digest is kept."""
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            raise IntegrityFailure(f"artifact digest {digest!r} is not a SHA-256")
        return self._artifacts / digest

    async def fetch(
        self,
        conn: DeviceConnection,
        digest: str,
        size: int,
        timings: InstallTimings | None,
        segments: bytes = b"",
        url: str = "",
    ) -> Path:
        """Download an artifact (resuming a partial one), check it, keep it.

        From the presigned `url` when the assignment carries a usable one, else from the
        control plane; the control plane's Download takes over where the URL fails or
        sends a segment that does not verify.

        With `segments` (the signed per-segment digests) each segment is checked as it
        arrives and only verified segments reach the disk; a restart resumes at the first
        segment not held verified. Without them (older versions) the whole file's digest
        is checked at the end.
        """
        final = self.artifact_path(digest)
        if final.exists():
            return final  # verified when it was stored; decryption authenticates it again
        part = final.with_name(final.name + ".part")
        if segments:
            offset = await asyncio.to_thread(verified_prefix, part, segments, size)
            if part.exists() and part.stat().st_size != offset:
                os.truncate(part, offset)  # drop what a crash left unverified
        else:
            offset = part.stat().st_size if part.exists() else 0
            if offset > size:
                part.unlink()
                offset = 0
        free = shutil.disk_usage(self._artifacts).free
        if free < size - offset + DISK_MARGIN_BYTES:
            raise DiskFull(
                f"not enough disk space for a {size}-byte artifact in "
                f"{self._artifacts}: {free} bytes free"
            )
        started = time.monotonic()
        fd = -1
        try:
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
            if offset < size:  # a complete part (killed before its rename) needs nothing
                await self._receive(conn, fd, digest, size, offset, segments, url, timings)
            os.fsync(fd)
        except errors.IntegrityError as exc:
            # The verified segments stay: the next attempt fetches from the bad one on.
            if fd >= 0 and os.fstat(fd).st_size == 0:
                part.unlink(missing_ok=True)
            raise IntegrityFailure(f"artifact {digest[:12]}: {exc}") from None
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                # The device needs its space more than the verified segments: give it back.
                part.unlink(missing_ok=True)
                raise DiskFull(f"disk full while downloading artifact {digest[:12]}") from None
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        checked = time.monotonic()
        if not segments:
            got = _sha256_file(part)
            if part.stat().st_size != size or got != digest:
                part.unlink()  # start over next time: these bytes are not the artifact
                raise IntegrityFailure(f"artifact {digest[:12]}: downloaded bytes do not match")
        elif part.stat().st_size != size:
            raise IntegrityFailure(f"artifact {digest[:12]}: {part.stat().st_size} of {size} bytes")
        self._keep(part, final)
        if timings is not None:
            timings.download_s = checked - started
            timings.verify_s = time.monotonic() - checked
            timings.downloaded_bytes = size - offset
            timings.resumed_from = offset
        return final

    def _keep(self, part: Path, final: Path) -> None:
        """Make a verified download the artifact: one rename, made durable."""
        os.replace(part, final)
        fsync_dir(final.parent)

    async def _receive(
        self,
        conn: DeviceConnection,
        fd: int,
        digest: str,
        size: int,
        offset: int,
        segments: bytes,
        url: str,
        timings: InstallTimings | None,
    ) -> None:
        """Write [offset, size) of an artifact to `fd`: verified segments only, if signed.

        The presigned URL first, when usable; the control plane from the first byte the
        URL did not deliver, or from the first segment of the URL's that did not verify.
        """
        checker = SegmentChecker(segments, size, offset // SEGMENT_SIZE) if segments else None
        received = offset
        if url and usable_url(url):
            try:
                async for data in fetch_url(url, offset, size):
                    write_all(fd, checker.feed(data) if checker else data)
                    received += len(data)
                    if timings is not None:
                        timings.url_bytes += len(data)
                if checker is not None:
                    write_all(fd, checker.finish())
                return
            except UrlFetchError as exc:
                log.info("artifact %s: presigned URL failed (%s)", digest[:12], exc)
            except errors.IntegrityError as exc:
                if checker is None:
                    raise
                # The store's bytes are bad; the control plane's may not be.
                log.warning("artifact %s: from the presigned URL, %s", digest[:12], exc)
                checker.restart()
                received = checker.verified_bytes
            log.info("artifact %s: from the control plane from byte %d", digest[:12], received)
        elif url:
            log.warning("artifact %s: not fetching from a plain-HTTP URL off loopback", digest[:12])
        async for _, data in conn.download(digest, size=size, offset=received):
            write_all(fd, checker.feed(data) if checker else data)
        if checker is not None:
            write_all(fd, checker.finish())


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
