from __future__ import annotations

import gc
import hashlib
import io
import os
import random
import tracemalloc
from collections.abc import Iterator

import pytest
import tink
from tink import secret_key_access, streaming_aead

from contract import errors
from contract.envelope import (
    SEGMENT_SIZE,
    ciphertext_size,
    decrypt_stream,
    encrypt_stream,
    new_data_key,
)

AD = b"model=resnet;version=3"
FIRST = SEGMENT_SIZE - 40 - 16  # plaintext bytes in segment 0 (header + tag share it)
OTHER = SEGMENT_SIZE - 16  # plaintext bytes in every later segment
MiB = 1 << 20


def encrypt(key: bytes, plaintext: bytes, ad: bytes = AD) -> bytes:
    out = io.BytesIO()
    written = encrypt_stream(key, [plaintext], out, associated_data=ad)
    assert written == len(out.getvalue())
    return out.getvalue()


def decrypt(key: bytes, ciphertext: bytes, ad: bytes = AD) -> bytes:
    return b"".join(decrypt_stream(key, io.BytesIO(ciphertext), associated_data=ad))


def split_randomly(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    chunks, offset = [], 0
    while offset < len(data):
        size = rng.choice([1, 7, 4096, 100_000, MiB, 3 * MiB])
        chunks.append(data[offset : offset + size])
        offset += size
    return chunks


@pytest.fixture(scope="module")
def key() -> bytes:
    return new_data_key()


@pytest.mark.parametrize(
    "size", [0, 1, FIRST - 1, FIRST, FIRST + 1, FIRST + OTHER, FIRST + OTHER + 1, 3 * MiB + 5]
)
def test_round_trip_and_exact_size(key: bytes, size: int) -> None:
    plaintext = os.urandom(size)
    out = io.BytesIO()
    written = encrypt_stream(key, split_randomly(plaintext, size), out, associated_data=AD)
    ciphertext = out.getvalue()
    assert written == len(ciphertext) == ciphertext_size(size)
    assert not out.closed  # the caller's file stays theirs
    # A short plaintext can turn up in random bytes by chance; a 16-byte one cannot.
    assert size < 16 or plaintext not in ciphertext
    chunks = split_randomly(ciphertext, size + 1)
    assert b"".join(decrypt_stream(key, iter(chunks), associated_data=AD)) == plaintext
    assert decrypt(key, ciphertext) == plaintext


def tink_decrypt(key: bytes, ciphertext: bytes, ad: bytes = AD) -> bytes:
    """Decrypt with Tink's own decrypting stream: the reference decrypt_stream must match."""
    handle = tink.proto_keyset_format.parse(key, secret_key_access.TOKEN)
    primitive = handle.primitive(streaming_aead.StreamingAead)
    with primitive.new_decrypting_stream(io.BytesIO(ciphertext), ad) as stream:
        return stream.read()


@pytest.mark.parametrize(
    "size", [0, 1, FIRST, FIRST + 1, FIRST + OTHER, FIRST + 2 * OTHER, 2 * MiB + 12345]
)
def test_decryption_agrees_with_tinks_own(key: bytes, size: int) -> None:
    plaintext = os.urandom(size)
    ciphertext = encrypt(key, plaintext, ad=b"ad-" + str(size).encode())
    assert tink_decrypt(key, ciphertext, ad=b"ad-" + str(size).encode()) == plaintext
    chunks = split_randomly(ciphertext, size)
    pieces = list(decrypt_stream(key, iter(chunks), associated_data=b"ad-" + str(size).encode()))
    assert b"".join(pieces) == plaintext
    assert all(pieces)  # an empty plaintext yields nothing, never b""


def test_ciphertext_size_formula_at_segment_boundaries() -> None:
    assert ciphertext_size(0) == 56
    assert ciphertext_size(FIRST) == SEGMENT_SIZE
    assert ciphertext_size(FIRST + OTHER) == 2 * SEGMENT_SIZE
    assert ciphertext_size(FIRST + OTHER + 1) == 2 * SEGMENT_SIZE + 17
    with pytest.raises(errors.InvalidArgument):
        ciphertext_size(-1)


def test_decrypt_yields_bounded_chunks(key: bytes) -> None:
    ciphertext = encrypt(key, os.urandom(3 * MiB))
    sizes = [len(c) for c in decrypt_stream(key, io.BytesIO(ciphertext), associated_data=AD)]
    assert sum(sizes) == 3 * MiB
    assert max(sizes) <= SEGMENT_SIZE


def test_data_keys_are_fresh_streaming_keysets() -> None:
    first, second = new_data_key(), new_data_key()
    assert first != second
    handle = tink.proto_keyset_format.parse(first, secret_key_access.TOKEN)
    assert handle.keyset_info().key_info[0].type_url.endswith("AesGcmHkdfStreamingKey")


@pytest.mark.slow
def test_memory_stays_flat_for_64_mib(key: bytes, tmp_path) -> None:
    total = 64 * MiB
    digest = hashlib.sha256()

    def chunks() -> Iterator[bytes]:
        for _ in range(total // MiB):
            chunk = os.urandom(MiB)
            digest.update(chunk)
            yield chunk

    path = tmp_path / "artifact.enc"
    tracemalloc.start()
    try:
        with path.open("wb") as out:
            written = encrypt_stream(key, chunks(), out, associated_data=AD)
        _, encrypt_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        check = hashlib.sha256()
        with path.open("rb") as src:
            for chunk in decrypt_stream(key, src, associated_data=AD):
                check.update(chunk)
        _, decrypt_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert written == path.stat().st_size == ciphertext_size(total)
    assert check.digest() == digest.digest()
    assert encrypt_peak < 8 * MiB, encrypt_peak
    assert decrypt_peak < 8 * MiB, decrypt_peak


# Four segments, the last one partial: enough to tamper with, drop and swap segments.
@pytest.fixture(scope="module")
def multi(key: bytes) -> tuple[bytes, bytes]:
    plaintext = os.urandom(FIRST + 2 * OTHER + 1000)
    return plaintext, encrypt(key, plaintext)


@pytest.mark.parametrize("offset", [0, 5, 39, 40, SEGMENT_SIZE - 1, SEGMENT_SIZE + 10, -1])
def test_tampering_any_segment_fails(key: bytes, multi: tuple[bytes, bytes], offset: int) -> None:
    ciphertext = bytearray(multi[1])
    ciphertext[offset] ^= 0x01
    with pytest.raises(errors.IntegrityError, match="failed authentication"):
        decrypt(key, bytes(ciphertext))


@pytest.mark.parametrize("segments", [1, 2, 3])
def test_truncation_at_segment_boundary_fails(
    key: bytes, multi: tuple[bytes, bytes], segments: int
) -> None:
    with pytest.raises(errors.IntegrityError):
        decrypt(key, multi[1][: segments * SEGMENT_SIZE])


@pytest.mark.parametrize("cut", [1, 39, 40, 1000])
def test_truncation_inside_a_segment_fails(key: bytes, multi: tuple[bytes, bytes], cut: int):
    with pytest.raises(errors.IntegrityError):
        decrypt(key, multi[1][:-cut])


def test_empty_ciphertext_fails(key: bytes) -> None:
    with pytest.raises(errors.IntegrityError):
        decrypt(key, b"")


def test_swapping_or_dropping_segments_fails(key: bytes, multi: tuple[bytes, bytes]) -> None:
    s = SEGMENT_SIZE
    ct = multi[1]
    swapped = ct[:s] + ct[2 * s : 3 * s] + ct[s : 2 * s] + ct[3 * s :]
    dropped = ct[:s] + ct[2 * s :]
    for bad in (swapped, dropped):
        with pytest.raises(errors.IntegrityError):
            decrypt(key, bad)


def test_wrong_associated_data_fails(key: bytes) -> None:
    ciphertext = encrypt(key, b"weights")
    with pytest.raises(errors.IntegrityError):
        decrypt(key, ciphertext, ad=AD + b"x")


def test_wrong_key_fails(key: bytes) -> None:
    ciphertext = encrypt(key, b"weights")
    with pytest.raises(errors.IntegrityError) as raised:
        decrypt(new_data_key(), ciphertext)
    assert key.hex() not in str(raised.value)


def test_plaintext_before_a_bad_segment_is_yielded_then_error(
    key: bytes, multi: tuple[bytes, bytes]
) -> None:
    ciphertext = bytearray(multi[1])
    ciphertext[2 * SEGMENT_SIZE + 100] ^= 0x80
    chunks = decrypt_stream(key, io.BytesIO(bytes(ciphertext)), associated_data=AD)
    assert next(chunks) == multi[0][:FIRST]  # the consumer must discard this on error
    with pytest.raises(errors.IntegrityError):
        list(chunks)


@pytest.mark.parametrize(
    "bad_key",
    [
        b"",
        b"not a keyset",
        tink.proto_keyset_format.serialize(
            tink.new_keyset_handle(streaming_aead.streaming_aead_key_templates.AES256_GCM_HKDF_4KB),
            secret_key_access.TOKEN,
        ),
    ],
    ids=["empty", "not-a-keyset", "4kb-segments"],  # fixed: xdist workers must agree
)
def test_malformed_data_key_is_refused_eagerly(bad_key: bytes) -> None:
    with pytest.raises(errors.IntegrityError, match="data key"):
        decrypt_stream(bad_key, io.BytesIO(b""), associated_data=AD)
    with pytest.raises(errors.IntegrityError, match="data key"):
        encrypt_stream(bad_key, [b"x"], io.BytesIO(), associated_data=AD)


def test_source_errors_propagate_unchanged(key: bytes) -> None:
    ciphertext = encrypt(key, os.urandom(2 * MiB))

    def flaky() -> Iterator[bytes]:
        yield ciphertext[: SEGMENT_SIZE + 10]
        raise ConnectionResetError("peer went away")

    with pytest.raises(ConnectionResetError):
        list(decrypt_stream(key, flaky(), associated_data=AD))


def test_failed_encryption_never_completes_the_ciphertext(key: bytes) -> None:
    def failing() -> Iterator[bytes]:
        yield os.urandom(2 * MiB)
        raise OSError("upload interrupted")

    out = io.BytesIO()
    with pytest.raises(OSError, match="upload interrupted"):
        encrypt_stream(key, failing(), out, associated_data=AD)
    gc.collect()  # an abandoned Tink stream finalizes itself on collection
    with pytest.raises(errors.IntegrityError):
        decrypt(key, out.getvalue())


def test_sink_errors_propagate_unchanged(key: bytes) -> None:
    class Full(io.BytesIO):
        def write(self, data) -> int:  # type: ignore[override]
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        encrypt_stream(key, [os.urandom(2 * MiB)], Full(), associated_data=AD)
