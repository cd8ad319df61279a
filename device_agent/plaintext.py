"""Where an installed version's plaintext comes from: its one artifact, or its chunks.

Either way it is decrypted piece by piece into memory only, and checked as it goes
against the size and SHA-256 the signed manifest gives: a reader that gets to the end
has exactly the published bytes; one that does not gets IntegrityFailure naming where.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from contract.chunks import ChunkTable
from device_agent.chunk_store import ChunkStore, OpenedChunks
from device_agent.download import IntegrityFailure


@dataclass(frozen=True)
class Plaintext:
    """An installed variant's plaintext, decrypted on demand."""

    name: str  # for messages: "artifact 1a2b3c4d5e6f" or "chunks of 1a2b3c4d5e6f"
    sha256: str
    size: int
    pieces: Callable[[], Iterator[bytes]]

    def checked(self) -> Iterator[bytes]:
        """Yield the plaintext; IntegrityFailure if it is not what the manifest signs.

        The size is checked as pieces come (never more than signed is yielded), the
        digest once the last piece is out.
        """
        digest, size = hashlib.sha256(), 0
        try:
            for piece in self.pieces():
                size += len(piece)
                if size > self.size:
                    raise IntegrityFailure(f"{self.name}: longer than signed")
                digest.update(piece)
                yield piece
        except IntegrityFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - Tink raises its own errors for bad segments
            raise IntegrityFailure(f"{self.name} does not decrypt: {exc}") from None
        if size != self.size or digest.hexdigest() != self.sha256:
            raise IntegrityFailure(f"{self.name}: plaintext does not match its digest")

    def read(self) -> bytes:
        """Return the whole plaintext, checked."""
        # One copy, once every piece is in and checked (a bytearray grown piece by piece,
        # then turned into bytes, copied it twice).
        return b"".join(list(self.checked()))


def from_artifact(
    path: Path, key: bytes, associated_data: bytes, sha256: str, size: int
) -> Plaintext:
    """Return the plaintext of one Tink-encrypted artifact file."""

    def pieces() -> Iterator[bytes]:
        from contract.envelope import decrypt_stream  # Tink: not held by an idle agent

        with open(path, "rb") as f:
            yield from decrypt_stream(key, f, associated_data=associated_data)

    return Plaintext(f"artifact {path.name[:12]}", sha256, size, pieces)


def from_chunks(
    store: ChunkStore,
    table: ChunkTable,
    keys: dict[bytes, bytes],
    model: str,
    sha256: str,
    size: int,
    opened: OpenedChunks | None = None,
) -> Plaintext:
    """Return the plaintext a chunk table makes, in table order.

    From `opened` for the chunks opened as they were fetched, else from the chunk store.
    """
    return Plaintext(
        f"chunks of {sha256[:12]}",
        sha256,
        size,
        lambda: store.plaintext(table, keys, model, opened),
    )
