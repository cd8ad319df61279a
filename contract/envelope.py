"""Streaming envelope encryption of model artifacts with Tink's AES-GCM-HKDF streaming AEAD.

Each model version gets a fresh *data key*: a serialized Tink keyset holding one
AES256_GCM_HKDF_1MB streaming key. The artifact is cut into 1 MiB ciphertext segments,
each authenticated on its own, so a download can be resumed and verified segment by
segment while memory stays bounded by one segment.

Ciphertext format (Tink's, see "Streaming AEAD" in the Tink wire-format docs), with
S = SEGMENT_SIZE, H = 40 and T = 16::

    header (H bytes) = header length (1) || HKDF salt (32) || nonce prefix (7)
    segment 0        = the header, then up to S - H - T plaintext bytes, then a GCM tag
    segment i > 0    = up to S - T plaintext bytes, then a GCM tag

Each segment is AES-256-GCM under the key HKDF-SHA256(key value, salt, info = the
associated data) with the nonce nonce prefix || index (4 bytes, big-endian) || "last
segment" flag (1 byte), so reordering, dropping or truncating segments (even exactly
at a segment boundary) fails authentication. Tink never emits an empty trailing
segment, which makes the size of a ciphertext a pure function of the plaintext size
(`ciphertext_size`).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import tink
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from google.protobuf.message import DecodeError
from tink import secret_key_access, streaming_aead
from tink.proto import aes_gcm_hkdf_streaming_pb2, common_pb2, tink_pb2

from contract import errors
from contract.segments import SEGMENT_SIZE

_HEADER_SIZE = 1 + 32 + 7  # length byte + salt (= derived key size) + nonce prefix
_TAG_SIZE = 16
_FIRST_SEGMENT_PLAINTEXT = SEGMENT_SIZE - _HEADER_SIZE - _TAG_SIZE
_SEGMENT_PLAINTEXT = SEGMENT_SIZE - _TAG_SIZE
_KEY_TYPE_URL = "type.googleapis.com/google.crypto.tink.AesGcmHkdfStreamingKey"
_TEMPLATE = streaming_aead.streaming_aead_key_templates.AES256_GCM_HKDF_1MB
# Segment indices are 32-bit in the nonce.
_MAX_SEGMENT_INDEX = (1 << 32) - 1
_TAMPERED = "ciphertext failed authentication (tampered, truncated, wrong key or wrong AD)"

streaming_aead.register()


def new_data_key() -> bytes:
    """Return a fresh serialized Tink keyset holding one AES256_GCM_HKDF_1MB key (secret)."""
    handle = tink.new_keyset_handle(_TEMPLATE)
    return tink.proto_keyset_format.serialize(handle, secret_key_access.TOKEN)


def ciphertext_size(plaintext_size: int) -> int:
    """Return the exact ciphertext size for a plaintext of `plaintext_size` bytes.

    One header, plus the plaintext, plus one tag per segment. The first segment holds
    fewer plaintext bytes because the header shares it; an empty plaintext still
    produces one (empty, authenticated) segment.
    """
    if plaintext_size < 0:
        raise errors.InvalidArgument("plaintext size must not be negative")
    extra = max(0, plaintext_size - _FIRST_SEGMENT_PLAINTEXT)
    segments = 1 + -(-extra // _SEGMENT_PLAINTEXT)  # ceiling division
    return _HEADER_SIZE + plaintext_size + segments * _TAG_SIZE


def encrypt_stream(
    data_key: bytes, chunks: Iterable[bytes], out: BinaryIO, *, associated_data: bytes
) -> int:
    """Encrypt `chunks` into `out` and return the number of ciphertext bytes written.

    Memory use is bounded by one segment plus one input chunk. `out` is left open.
    If reading `chunks` or writing `out` fails, the error propagates and the final
    segment is *not* written, so a partial output never authenticates as complete.
    """
    written = 0
    ciphertext = encrypt_chunks(data_key, chunks, associated_data=associated_data)
    with contextlib.closing(ciphertext):  # closing aborts a half-written stream
        for piece in ciphertext:
            out.write(piece)
            written += len(piece)
    return written


def encrypt_chunks(
    data_key: bytes, chunks: Iterable[bytes], *, associated_data: bytes
) -> Iterator[bytes]:
    """Yield the ciphertext of `chunks` as it is produced, e.g. into a blob store.

    Memory use is bounded by one segment plus one input chunk. If `chunks` raises or
    the consumer stops early, the final segment is never produced, so a partial
    ciphertext never authenticates as complete.
    """
    primitive = _primitive(data_key)
    pending: list[bytes] = []
    sink = _Sink(_Collector(pending))
    try:
        stream = primitive.new_encrypting_stream(sink, associated_data)
        for chunk in chunks:
            stream.write(chunk)
            if pending:
                yield b"".join(pending)
                pending.clear()
        stream.close()  # encrypts and writes the final, "last"-flagged segment
    except BaseException:
        # The abandoned stream would finalize itself when garbage-collected;
        # aborting the sink drops that write instead of completing a truncated file.
        sink.abort()
        raise
    if pending:
        yield b"".join(pending)


class _Collector:
    """Write target that keeps what Tink writes until the generator hands it on."""

    def __init__(self, pending: list[bytes]) -> None:
        self._pending = pending

    def write(self, data: bytes | bytearray | memoryview) -> int:
        """Keep a copy of `data` (Tink may reuse its buffer)."""
        self._pending.append(bytes(data))
        return len(data)


def decrypt_stream(
    data_key: bytes, src: BinaryIO | Iterable[bytes], *, associated_data: bytes
) -> Iterator[bytes]:
    """Yield the plaintext of `src` (a readable binary file or an iterable of chunks).

    Segments are authenticated one by one, so plaintext is yielded before the whole
    ciphertext is checked: a consumer must discard everything it received if the
    iteration ends in `errors.IntegrityError`. `src` is left open.

    Tink's Python decrypting stream passes every segment through several Python file
    objects, each copying it, and ran at under half the speed of one AES-GCM call per
    segment; so segments are opened here, one call each, as the format above says, with
    pyca/cryptography's HKDF and AES-GCM. Tests check it against Tink's own stream.
    Encryption, and so the format, stays Tink's.
    """
    key = _key_value(data_key)  # validated eagerly, not on the first next()
    chunks = _read_chunks(src) if hasattr(src, "read") else iter(src)
    return _decrypt(key, _segments(chunks), associated_data)


def _decrypt(key: bytes, segments: Iterator[bytes], associated_data: bytes) -> Iterator[bytes]:
    """Yield each segment's plaintext; a segment is last when no other follows it."""
    first = next(segments, b"")
    if len(first) < _HEADER_SIZE + _TAG_SIZE or first[0] != _HEADER_SIZE:
        raise errors.IntegrityError(_TAMPERED)
    salt, prefix = first[1:33], first[33:_HEADER_SIZE]
    derived = HKDF(hashes.SHA256(), 32, salt=salt, info=associated_data).derive(key)
    aead = AESGCM(derived)
    segment, index = memoryview(first)[_HEADER_SIZE:], 0
    while True:
        following = next(segments, None)
        last = following is None
        if index > _MAX_SEGMENT_INDEX:
            raise errors.IntegrityError(_TAMPERED)
        nonce = prefix + index.to_bytes(4, "big") + (b"\x01" if last else b"\x00")
        try:
            plaintext = aead.decrypt(nonce, segment, None)
        except InvalidTag:
            raise errors.IntegrityError(_TAMPERED) from None
        if plaintext:
            yield plaintext
        if last:
            return
        segment, index = following, index + 1


def _segments(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """Cut a stream of chunks of any sizes into SEGMENT_SIZE pieces (the last may be short).

    A chunk that is already one whole segment, as a file read of SEGMENT_SIZE gives,
    passes through without a copy.
    """
    pending = bytearray()
    for chunk in chunks:
        if not pending and len(chunk) == SEGMENT_SIZE:
            yield chunk
            continue
        pending += chunk
        while len(pending) >= SEGMENT_SIZE:
            yield bytes(pending[:SEGMENT_SIZE])
            del pending[:SEGMENT_SIZE]
    if pending:
        yield bytes(pending)


def _primitive(data_key: bytes) -> streaming_aead.StreamingAead:
    """Parse and check a data key; its parameters fix the format `ciphertext_size` predicts."""
    try:
        _check_params(tink_pb2.Keyset.FromString(data_key))
        handle = tink.proto_keyset_format.parse(data_key, secret_key_access.TOKEN)
        return handle.primitive(streaming_aead.StreamingAead)
    except (tink.TinkError, DecodeError, _ParamsError):
        # `from None`: parser messages are not ours to vouch for; keep key bytes out.
        raise errors.IntegrityError("data key is not an AES256_GCM_HKDF_1MB keyset") from None


def _key_value(data_key: bytes) -> bytes:
    """Return the streaming key's secret bytes, after the checks `_primitive` makes."""
    _primitive(data_key)
    keyset = tink_pb2.Keyset.FromString(data_key)
    return aes_gcm_hkdf_streaming_pb2.AesGcmHkdfStreamingKey.FromString(
        keyset.key[0].key_data.value
    ).key_value


class _ParamsError(ValueError):
    """The keyset parsed but does not hold exactly the expected key type and parameters."""


def _check_params(keyset: tink_pb2.Keyset) -> None:
    if len(keyset.key) != 1 or keyset.key[0].key_data.type_url != _KEY_TYPE_URL:
        raise _ParamsError("expected exactly one AesGcmHkdfStreamingKey")
    key = aes_gcm_hkdf_streaming_pb2.AesGcmHkdfStreamingKey.FromString(keyset.key[0].key_data.value)
    params = key.params
    if (
        len(key.key_value) != 32
        or params.derived_key_size != 32
        or params.hkdf_hash_type != common_pb2.SHA256
        or params.ciphertext_segment_size != SEGMENT_SIZE
    ):
        raise _ParamsError("unexpected streaming key parameters")


def _read_chunks(f: BinaryIO) -> Iterator[bytes]:
    while chunk := f.read(SEGMENT_SIZE):
        yield chunk


class _Sink(io.RawIOBase):
    """Writable raw stream that forwards to `out`, counts bytes, and never closes `out`."""

    def __init__(self, out: BinaryIO) -> None:
        super().__init__()
        self._out = out
        self._aborted = False
        self.written = 0
        self.error: BaseException | None = None

    def writable(self) -> bool:
        """Return True: this is a sink."""
        return True

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        """Write all of `data` to `out` (or drop it once aborted); return its length."""
        if self._aborted:
            return len(data)
        try:
            self._out.write(data)
        except Exception as exc:
            self.error = exc
            raise
        self.written += len(data)
        return len(data)

    def abort(self) -> None:
        """Drop every later write, including the final segment a stray close() would add."""
        self._aborted = True
