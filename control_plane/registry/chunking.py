"""Cutting a version's plaintext into content-defined chunks and sealing them (push side).

FastCDC (Xia et al., USENIX ATC 2016, through the `fastcdc` package) puts a chunk
boundary wherever a rolling hash of the last bytes hits a pattern, so an insertion or a
change in one tensor moves only the boundaries around it: the chunks before and after
are the same bytes as in the previous version, hence the same ids (`contract.chunks`).
A bundle's files are cut each on its own (its tar headers and members are spans), so a
changed chat template costs its file's chunks and its header, never a neighbour's.
"""

from __future__ import annotations

import tarfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from fastcdc import fastcdc

from contract import chunks, errors

AVG_CHUNK = 256 << 10
# Bytes relabelled (copied) at a time: many chunks, never the whole model twice in memory.
WINDOW = 16 << 20
# Variants smaller than this keep the one-artifact format: a few chunks would save a
# device next to nothing, and the one artifact has presigned URLs and resumable segments.
CHUNKED_MIN_BYTES = 4 * AVG_CHUNK
# fastcdc's bounds on the average it accepts, narrowed to what a device should buffer.
MIN_AVG_CHUNK, MAX_AVG_CHUNK = 64 << 10, 1 << 20


@dataclass(frozen=True)
class SealedChunk:
    """One chunk as the blob store keeps it, with the key a device will need for it."""

    ref: chunks.ChunkRef
    key: bytes
    ciphertext: bytes


def check_average(avg: int) -> int:
    """Return `avg` if it is an allowed average chunk size; InvalidArgument otherwise."""
    if type(avg) is not int or not MIN_AVG_CHUNK <= avg <= MAX_AVG_CHUNK or avg & (avg - 1):
        raise errors.InvalidArgument(
            f"the average chunk size must be a power of two in {MIN_AVG_CHUNK >> 10}.."
            f"{MAX_AVG_CHUNK >> 10} KiB, got {avg}"
        )
    return avg


def cut(
    data: bytes | memoryview,
    *,
    avg: int = AVG_CHUNK,
    spans: Sequence[int] = (),
    relabel: bytes | None = None,
) -> Iterator[memoryview]:
    """Yield `data` as content-defined chunks, in order, together exactly `data`.

    `spans` are offsets where a chunk must end (a bundle's file boundaries); FastCDC
    cuts within each span. With `relabel` (a byte permutation, contract.chunks.
    boundary_relabel), boundaries are found on the relabelled bytes, so only its holder
    can predict them. An empty `data` is one empty chunk.
    """
    view = memoryview(data).cast("B")
    check_average(avg)
    if not len(view):
        yield view
        return
    edges = sorted({0, len(view), *(s for s in spans if 0 < s < len(view))})
    for start, end in zip(edges, edges[1:], strict=False):
        span = view[start:end]
        at = 0
        for length in _lengths(span, avg, relabel):
            yield span[at : at + length]
            at += length


def _lengths(span: memoryview, avg: int, relabel: bytes | None) -> Iterator[int]:
    """Yield the chunk lengths of one span, WINDOW bytes relabelled at a time.

    FastCDC decides each boundary from the chunk's own start, so a window that ends
    mid-chunk loses nothing: its last chunk is dropped and the next window starts there.
    """
    if len(span) <= avg // 4:  # below FastCDC's minimum: one chunk
        yield len(span)
        return
    at, size = 0, max(WINDOW, 8 * 4 * avg)  # many chunks of at most 4 * avg per window
    while at < len(span):
        window = span[at : at + size]
        cut_on = window if relabel is None else window.tobytes().translate(relabel)
        found = [
            c.length for c in fastcdc(cut_on, min_size=avg // 4, avg_size=avg, max_size=avg * 4)
        ]
        if at + len(window) < len(span):
            found = found[:-1]  # cut by the window's end, not by the content
        yield from found
        at += sum(found)


def tar_spans(fileobj) -> list[int]:
    """Return the offsets where a canonical bundle tar's headers and members begin.

    A member's padding stays with its data: a file that grows or shrinks changes its
    header and its own chunks (data and padding), never a third one.
    """
    spans: list[int] = []
    with tarfile.open(fileobj=fileobj, mode="r:") as tar:
        for member in tar:
            spans += [member.offset, member.offset_data]
    return spans


def seal(
    secret: bytes,
    model_uid: str,
    data: bytes | memoryview,
    *,
    avg: int = AVG_CHUNK,
    spans: Sequence[int] = (),
) -> Iterator[SealedChunk]:
    """Yield each chunk of `data` sealed under its content-derived key, in order.

    Its boundaries are keyed by the model's secret too (contract.chunks.boundary_relabel).
    """
    relabel = chunks.boundary_relabel(secret, model_uid)
    for piece in cut(data, avg=avg, spans=spans, relabel=relabel):
        key = chunks.chunk_key(secret, model_uid, piece)
        ciphertext = chunks.seal_chunk(key, model_uid, piece)
        yield SealedChunk(chunks.ChunkRef(chunks.chunk_id(ciphertext), len(piece)), key, ciphertext)
