"""Artifacts the simulator has fetched, decrypted and checked, by ciphertext digest.

A real device downloads and decrypts every artifact itself. Thousands of simulated devices
doing so in one process would measure this process's CPU, not the control plane, so the
first device assigned an artifact downloads it, checks the ciphertext digest, decrypts it
with the data key it unwrapped and checks the plaintext digest. Every later device still
verifies its own signed assignment and unwraps its own key; the cache then proves that
key is the one that opened the bytes (same key digest), which is what decrypting again
would prove.
"""

from __future__ import annotations

import asyncio
import hashlib
import tempfile
from dataclasses import dataclass

from contract import errors
from contract.assignment import VerifiedModel
from contract.device_client import DeviceConnection
from contract.envelope import decrypt_stream


@dataclass(frozen=True)
class Opened:
    """An artifact that decrypted to the expected plaintext under one data key."""

    key_sha256: str
    plaintext_sha256: str
    associated_data: bytes


class ArtifactCache:
    """Download and decrypt each distinct artifact once per process."""

    def __init__(self) -> None:
        self._opened: dict[str, Opened] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self.downloads = 0
        self.bytes_downloaded = 0

    async def check(self, conn: DeviceConnection, model: VerifiedModel, data_key: bytes) -> None:
        """Make sure `data_key` opens `model`'s artifact to its plaintext digest.

        IntegrityError when the bytes, the key or the digests disagree.
        """
        digest = model.ciphertext_sha256
        lock = self._locks.setdefault(digest, asyncio.Lock())
        async with lock:  # one download per artifact, even when many devices ask at once
            if digest not in self._opened:
                self._opened[digest] = await self._fetch(conn, model, data_key)
        opened = self._opened[digest]
        if (
            opened.key_sha256 != hashlib.sha256(data_key).hexdigest()
            or opened.plaintext_sha256 != model.plaintext_sha256
            or opened.associated_data != model.associated_data
        ):
            raise errors.IntegrityError(f"{model.model}: data key does not open the artifact")

    async def _fetch(self, conn: DeviceConnection, model: VerifiedModel, key: bytes) -> Opened:
        # Spooled to disk so a gigabyte model does not sit in this process's memory.
        with tempfile.TemporaryFile(prefix="skiff-sim-") as spool:
            digest, size = hashlib.sha256(), 0
            async for _, data in conn.download(model.ciphertext_sha256, size=model.ciphertext_size):
                digest.update(data)
                spool.write(data)
                size += len(data)
            self.downloads += 1
            self.bytes_downloaded += size
            if size != model.ciphertext_size or digest.hexdigest() != model.ciphertext_sha256:
                raise errors.IntegrityError(f"{model.model}: ciphertext digest mismatch")
            spool.seek(0)
            # Decryption is CPU work; off the loop so watch streams keep being served.
            plain = await asyncio.to_thread(_plaintext_sha256, key, spool, model)
        if plain != model.plaintext_sha256:
            raise errors.IntegrityError(f"{model.model}: plaintext digest mismatch")
        return Opened(hashlib.sha256(key).hexdigest(), plain, model.associated_data)


def _plaintext_sha256(key: bytes, spool, model: VerifiedModel) -> str:
    digest, size = hashlib.sha256(), 0
    for chunk in decrypt_stream(key, spool, associated_data=model.associated_data):
        digest.update(chunk)
        size += len(chunk)
    if size != model.plaintext_size:
        raise errors.IntegrityError(f"{model.model}: plaintext size mismatch")
    return digest.hexdigest()
