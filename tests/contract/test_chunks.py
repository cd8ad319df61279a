"""Chunks shared across versions of one model, attacked the way the blob store or a device could.

The blob store holds ciphertexts and ids; a device holds the keys of the chunks of the
versions it is assigned. Neither may read, confirm or substitute anything else.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import tarfile

import pytest

from contract import chunks, errors
from control_plane.registry import chunking

UID, OTHER_UID = "m_0123456789abcdef", "m_fedcba9876543210"


def _data(n: int, seed: int = 0) -> bytes:
    return hashlib.shake_256(f"skiff-{seed}".encode()).digest(n)


def _sealed(data: bytes, secret: bytes, uid: str = UID, **kw) -> list[chunking.SealedChunk]:
    return list(chunking.seal(secret, uid, data, **kw))


def test_a_chunk_opens_with_its_key_and_is_the_same_bytes_in_every_version_of_its_model():
    secret, data = chunks.new_secret(), _data(3 << 20)
    first, again = _sealed(data, secret), _sealed(data, secret)
    assert [c.ref for c in first] == [c.ref for c in again]  # deterministic: stored once
    assert b"".join(chunks.open_chunk(c.key, UID, c.ref.id, c.ciphertext) for c in first) == data
    assert all(len(c.ciphertext) == c.ref.ciphertext_size for c in first)
    # The same plaintext in another model (another secret) shares nothing.
    other = _sealed(data, chunks.new_secret(), OTHER_UID)
    assert not {c.ref.id for c in first} & {c.ref.id for c in other}


def test_the_blob_store_cannot_confirm_a_guessed_plaintext():
    """Plain convergent encryption keys a chunk by its hash, so whoever guesses the
    plaintext can recompute the ciphertext and look for it. Here the key needs the
    model's secret: the same guess under any other secret (or none) is another blob."""
    secret, data = chunks.new_secret(), _data(300_000)
    stored = {c.ref.id for c in _sealed(data, secret)}
    for guess_secret in (bytes(chunks.SECRET_SIZE), chunks.new_secret()):
        assert not stored & {c.ref.id for c in _sealed(data, guess_secret)}
    naive_key = hashlib.sha512(data).digest()  # K = H(P), the textbook construction
    assert chunks.chunk_id(chunks.seal_chunk(naive_key, UID, data)) not in stored


def test_a_flipped_or_substituted_chunk_is_refused_before_it_is_decrypted():
    secret = chunks.new_secret()
    mine = _sealed(_data(200_000, 1), secret)[0]
    flipped = bytearray(mine.ciphertext)
    flipped[len(flipped) // 2] ^= 1
    with pytest.raises(errors.IntegrityError, match="does not match its signed digest"):
        chunks.open_chunk(mine.key, UID, mine.ref.id, bytes(flipped))
    # Another model's chunk of the very same length, in place of mine: refused by the id.
    other_plain = _data(mine.ref.size, 2)
    other_key = chunks.chunk_key(chunks.new_secret(), OTHER_UID, other_plain)
    other_ciphertext = chunks.seal_chunk(other_key, OTHER_UID, other_plain)
    theirs = chunking.SealedChunk(
        chunks.ChunkRef(chunks.chunk_id(other_ciphertext), mine.ref.size),
        other_key,
        other_ciphertext,
    )
    assert len(theirs.ciphertext) == len(mine.ciphertext)
    with pytest.raises(errors.IntegrityError, match="signed digest"):
        chunks.open_chunk(mine.key, UID, mine.ref.id, theirs.ciphertext)
    # Even under its own (valid) id, my key and model do not open it.
    with pytest.raises(errors.IntegrityError, match="failed authentication"):
        chunks.open_chunk(mine.key, UID, theirs.ref.id, theirs.ciphertext)
    # Nor does my chunk open as another model's with my key (the model is bound in).
    with pytest.raises(errors.IntegrityError, match="failed authentication"):
        chunks.open_chunk(mine.key, OTHER_UID, mine.ref.id, mine.ciphertext)


def test_a_key_opens_its_own_chunk_only():
    """A device holds the keys of its assigned versions' chunks; a new chunk of a version
    it is not assigned has a key derived from the model's secret it never saw."""
    secret = chunks.new_secret()
    old = _sealed(_data(1 << 20, 3), secret)
    new = _sealed(_data(1 << 20, 4), secret)
    for held in old:
        for c in new:
            with pytest.raises(errors.IntegrityError, match="failed authentication"):
                chunks.open_chunk(held.key, UID, c.ref.id, c.ciphertext)


def test_the_manifest_table_is_checked_before_anything_is_fetched():
    secret, data = chunks.new_secret(), _data(900_000, 5)
    sealed = _sealed(data, secret)
    table = chunks.ChunkTable(tuple(c.ref for c in sealed))
    doc = table.to_manifest()
    assert chunks.ChunkTable.from_manifest(doc, len(data)) == table
    bad = {
        "wrong total": (doc, len(data) + 1),
        "not base64": ({**doc, "ids": "%%%"}, len(data)),
        "ids and sizes": ({**doc, "sizes": doc["sizes"][:-1]}, len(data)),
        "size": ({**doc, "sizes": [*doc["sizes"][:-1], -1]}, len(data)),
        "not skiff": ({**doc, "scheme": "other"}, len(data)),
        "oversized": (
            {
                "scheme": chunks.SCHEME,
                "ids": base64.b64encode(b"x" * 32).decode(),
                "sizes": [1 << 30],
            },
            1 << 30,
        ),
    }
    for name, (document, size) in bad.items():
        with pytest.raises(errors.IntegrityError):
            chunks.ChunkTable.from_manifest(document, size)
            pytest.fail(f"{name}: accepted")


def test_a_table_may_repeat_a_chunk_but_not_give_it_two_keys():
    secret = chunks.new_secret()
    block = _data(300_000, 6)
    sealed = _sealed(block + block, secret, spans=[len(block)])
    assert sealed[0].ref == sealed[len(sealed) // 2].ref  # the repeated stretch: one chunk
    table = chunks.ChunkTable(tuple(c.ref for c in sealed))
    assert len(table.distinct()) == len(sealed) // 2
    keys = chunks.unpack_keys(chunks.pack_keys([c.key for c in sealed]), table)
    assert set(keys) == set(table.distinct())
    with pytest.raises(errors.IntegrityError, match="chunk keys for"):
        chunks.unpack_keys(chunks.pack_keys([c.key for c in sealed[:-1]]), table)
    forged = [c.key for c in sealed]
    forged[-1] = bytes(chunks.KEY_SIZE)
    with pytest.raises(errors.IntegrityError, match="two keys"):
        chunks.unpack_keys(chunks.pack_keys(forged), table)
    held = [sealed[0].ref.id]
    assert [c.id for c in table.missing_from(held)] == [
        c.ref.id for c in sealed[1 : len(sealed) // 2]
    ]


def test_an_edit_moves_only_the_chunks_around_it():
    secret = chunks.new_secret()
    data = bytearray(_data(8 << 20, 7))
    before = {c.ref.id for c in _sealed(bytes(data), secret)}
    data[3_000_000:3_000_000] = b"an insertion that shifts every later byte"
    data[6_000_000:6_000_064] = bytes(64)
    after = _sealed(bytes(data), secret)
    new = [c for c in after if c.ref.id not in before]
    assert 2 <= len(new) <= 6, len(new)
    assert sum(c.ref.size for c in new) < 0.25 * len(data)


def test_cutting_covers_the_data_exactly_and_keeps_file_boundaries():
    files = {"a.json": b'{"x": 1}', "b.bin": _data(700_000, 8), "c.txt": b""}
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for name, body in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    data = out.getvalue()
    spans = chunking.tar_spans(io.BytesIO(data))
    pieces = list(chunking.cut(data, spans=spans))
    assert b"".join(pieces) == data
    ends, at = set(), 0
    for p in pieces:
        at += len(p)
        ends.add(at)
    assert set(spans) - {0} <= ends
    assert [bytes(p) for p in chunking.cut(b"")] == [b""]
    for avg in (1000, 3 << 20, 96 << 10, True):
        with pytest.raises(errors.InvalidArgument, match="average chunk size"):
            list(chunking.cut(b"x", avg=avg))


def test_chunks_of_random_bytes_round_trip():
    secret, data = chunks.new_secret(), os.urandom(123_457)
    sealed = _sealed(data, secret, avg=64 << 10)
    assert sum(c.ref.size for c in sealed) == len(data)
    assert b"".join(chunks.open_chunk(c.key, UID, c.ref.id, c.ciphertext) for c in sealed) == data


def test_chunk_lengths_neither_confirm_a_guess_nor_link_two_models():
    """Boundaries are keyed by the model's secret: the same content in another model, or a
    guess cut without the secret, gives other chunk lengths than the stored ones."""
    data = _data(4 << 20, 30)
    stored = [c.ref.size for c in _sealed(data, chunks.new_secret())]
    other_model = [c.ref.size for c in _sealed(data, chunks.new_secret(), OTHER_UID)]
    unkeyed_guess = [len(p) for p in chunking.cut(data)]
    assert stored != other_model and stored != unkeyed_guess
    assert sum(stored) == sum(other_model) == len(data)


def test_windows_cut_exactly_where_one_pass_would():
    secret, data = chunks.new_secret(), _data(3 << 20, 31)
    relabel = chunks.boundary_relabel(secret, UID)
    assert sorted(relabel) == list(range(256))
    whole = [len(p) for p in chunking.cut(data, avg=64 << 10, relabel=relabel)]  # one window
    original = chunking.WINDOW
    try:
        chunking.WINDOW = 1 << 20  # raised to 8 largest chunks (2 MiB): two windows
        windowed = [len(p) for p in chunking.cut(data, avg=64 << 10, relabel=relabel)]
    finally:
        chunking.WINDOW = original
    assert windowed == whole
