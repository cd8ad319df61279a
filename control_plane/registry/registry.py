"""The model registry: transport-free handlers behind the admin gRPC service.

A push spools the upload into a memfd, converts and validates it with MNN in a child
process, derives variants, encrypts each under a fresh per-version data key, stores the
ciphertexts, and only then appends the version row. Anything that fails on the way
deletes what it stored, so no version exists without its blobs, no blob without its
version, and version numbers stay gapless.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import logging
import os
import re
import threading
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

from control_plane import errors
from control_plane.blobs import BlobStore
from control_plane.crypto import (
    SEGMENT_SIZE,
    KeyEncryptionKey,
    LocalKek,
    decrypt_stream,
    encrypt_chunks,
    new_data_key,
    rewrap,
)
from control_plane.registry import memfd, mnn_tools
from control_plane.registry.signing_keys import SigningKeys
from control_plane.store.base import (
    ModelRecord,
    NewVersion,
    RegistryStore,
    VariantRecord,
    VersionRecord,
)

log = logging.getLogger(__name__)

MODEL_NAME = re.compile(r"[a-z0-9_-]{1,64}")
# What a variant name and a version number may be anywhere they arrive from outside
# (rollouts, device reports): versions are int32 columns.
VARIANT_NAME = re.compile(r"[a-z0-9]{1,16}")
MAX_VERSION = 2**31 - 1
BASE_VARIANT = "fp32"
AEAD_NAME = "AES256_GCM_HKDF_1MB"
MANIFEST_SCHEMA = "skiff.manifest/v1"
# Concurrent MNN children per push; each holds a copy of a variant's weights.
INSPECT_WORKERS = 2


@dataclass(frozen=True)
class PushRequest:
    """What a caller asks for when pushing a model."""

    name: str
    actor: str
    notes: str = ""
    variants: tuple[str, ...] = ()
    filename: str = ""
    # What the client says it sent (0 / "" = not declared); checked after the upload.
    size: int = 0
    sha256: str = ""


def _check_upload(request: PushRequest, upload: memfd.Spooled) -> None:
    if upload.size == 0:
        raise errors.InvalidArgument("model file is empty")
    if request.size and upload.size != request.size:
        raise errors.InvalidArgument(f"upload truncated: got {upload.size} of {request.size} bytes")
    if request.sha256 and upload.sha256 != request.sha256.lower():
        raise errors.IntegrityError("upload does not match the SHA-256 the client declared")


def validate_name(name: str) -> str:
    """Return a valid model name or raise InvalidArgument naming the rule."""
    if not MODEL_NAME.fullmatch(name or ""):
        raise errors.InvalidArgument(
            f"invalid model name {name!r:.80}: use 1-64 of lowercase letters, digits, '-', '_'"
        )
    return name


def parse_ref(ref: str) -> tuple[str, int | None]:
    """Split NAME[:VERSION] into its parts; InvalidArgument when malformed."""
    name, sep, version = ref.partition(":")
    validate_name(name)
    if not sep:
        return name, None
    if not version.isdigit() or int(version) < 1:
        raise errors.InvalidArgument(f"invalid version {version!r} in {ref!r}: use 1, 2, ...")
    return name, int(version)


def _validate_variants(variants: Iterable[str]) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(variants))
    unknown = [v for v in chosen if v not in mnn_tools.VARIANTS]
    if unknown:
        allowed = ", ".join(mnn_tools.VARIANTS)
        raise errors.InvalidArgument(f"unknown variant {unknown[0]!r}: choose from {allowed}")
    return chosen


def associated_data(uid: str, variant: str) -> bytes:
    """Bind a ciphertext to its version and variant, so blobs cannot be swapped."""
    return f"skiff:{uid}:{variant}".encode()


class Registry:
    """Versioned, encrypted model registry."""

    def __init__(
        self,
        *,
        store: RegistryStore,
        blobs: BlobStore,
        kek: KeyEncryptionKey,
        signer: SigningKeys,
        max_model_bytes: int,
        mnn_timeout_s: float,
        max_concurrent_pushes: int = 2,
    ) -> None:
        self.store, self.blobs, self.kek, self.signer = store, blobs, kek, signer
        self.max_model_bytes = max_model_bytes
        self._mnn_timeout = mnn_timeout_s
        # Held from wrapping a data key until its row commits, and for a whole rotation,
        # so a rotation never misses a key wrapped under the KEK it is retiring. (One
        # process; replicas rotating concurrently would need a database lock.)
        self._kek_lock = threading.Lock()
        # A push holds its model (and each variant) in RAM and runs MNN children; on a
        # small box, unbounded concurrent pushes of large models would exhaust memory.
        self._push_slots = threading.BoundedSemaphore(max(1, max_concurrent_pushes))

    # -- push -------------------------------------------------------------------------

    def push(self, request: PushRequest, chunks: Iterable[bytes]) -> VersionRecord:
        """Validate, convert, encrypt and store a model as the next version."""
        validate_name(request.name)
        extra = _validate_variants(request.variants)
        stored: list[str] = []
        with self._push_slots, contextlib.ExitStack() as stack:
            upload = memfd.spool(chunks, limit=self.max_model_bytes)
            stack.callback(os.close, upload.fd)
            _check_upload(request, upload)
            try:
                fmt, fds = self._plaintext_variants(upload.fd, extra, stack)
                return self._store_version(request, fmt, fds, stored)
            except BaseException:
                self._delete_blobs(stored)
                raise

    def _plaintext_variants(
        self, upload_fd: int, extra: tuple[str, ...], stack: contextlib.ExitStack
    ) -> tuple[str, dict[str, int]]:
        """Return the source format and a memfd per variant (fp32 first)."""
        fmt = mnn_tools.sniff_format(upload_fd)
        base = upload_fd
        if fmt == "onnx":
            base = mnn_tools.convert_onnx(upload_fd, timeout=self._mnn_timeout)
            stack.callback(os.close, base)
        fds = {BASE_VARIANT: base}
        for name in extra:
            fds[name] = mnn_tools.make_variant(base, name, timeout=self._mnn_timeout)
            stack.callback(os.close, fds[name])
        return fmt, fds

    def _store_version(
        self, request: PushRequest, fmt: str, fds: dict[str, int], stored: list[str]
    ) -> VersionRecord:
        uid, data_key = uuid.uuid4().hex, new_data_key()
        # MNN loads each variant in a child process while this thread encrypts and stores:
        # the two dominate a push, and neither needs the other's result until the end.
        with ThreadPoolExecutor(INSPECT_WORKERS, thread_name_prefix="skiff-inspect") as pool:
            pending = {
                name: pool.submit(mnn_tools.inspect_model, fd, timeout=self._mnn_timeout)
                for name, fd in fds.items()
            }
            try:
                sealed = [
                    self._encrypt_variant(uid, n, fd, data_key, stored) for n, fd in fds.items()
                ]
                signatures = {name: future.result().to_dict() for name, future in pending.items()}
            except BaseException:
                for future in pending.values():
                    future.cancel()
                raise
        variants = tuple(replace(v, signature=signatures[v.name]) for v in sealed)
        created_at = dt.datetime.now(dt.UTC).replace(microsecond=0)

        def build(number: int) -> NewVersion:
            manifest = {
                "schema": MANIFEST_SCHEMA,
                "model": request.name,
                "version": number,
                "uid": uid,
                "created_at": created_at.isoformat(),
                "source_format": fmt,
                "signature": signatures[BASE_VARIANT],
                "variants": {v.name: _manifest_variant(uid, v) for v in variants},
            }
            signed = self.signer.sign(manifest)
            return NewVersion(
                uid=uid,
                created_at=created_at,
                created_by=request.actor,
                notes=request.notes,
                source_format=fmt,
                signature=signatures[BASE_VARIANT],
                variants=variants,
                data_key=self.kek.wrap(data_key, context=uid),
                manifest=signed.body,
                manifest_signature=signed.signature,
                signing_key_id=signed.key_id,
            )

        with self._kek_lock:
            record = self.store.create_version(request.name, build)
        # A rotation on another replica may have committed while this push signed.
        if self.signer.settle(record.signing_key_id):
            record = self.store.get_version(record.model, record.number)
        log.info("pushed %s:%d (%s)", record.model, record.number, ", ".join(fds))
        return record

    def _encrypt_variant(
        self, uid: str, name: str, fd: int, data_key: bytes, stored: list[str]
    ) -> VariantRecord:
        """Encrypt one plaintext memfd into the blob store, hashing it on the way."""
        digest, size = hashlib.sha256(), 0

        def plaintext() -> Iterator[bytes]:
            nonlocal size
            for chunk in memfd.read_chunks(fd):
                digest.update(chunk)
                size += len(chunk)
                yield chunk

        # Straight from memory into the blob store: only ciphertext is ever written.
        ciphertext = encrypt_chunks(
            data_key, plaintext(), associated_data=associated_data(uid, name)
        )
        info = self.blobs.put_stream(ciphertext)
        stored.append(info.key)
        return VariantRecord(
            name=name,
            plaintext_size=size,
            plaintext_sha256=digest.hexdigest(),
            ciphertext_size=info.size,
            ciphertext_sha256=info.key,
            segment_size=SEGMENT_SIZE,
            signature={},
        )

    def _delete_blobs(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.blobs.delete(key)
            except errors.SkiffError as exc:
                # Left for a later sweep; the version row was never written.
                log.warning("could not delete blob %s after a failed push: %s", key, exc)

    # -- read ---------------------------------------------------------------------------

    def list_models(self) -> list[ModelRecord]:
        """Return every model."""
        return self.store.list_models()

    def show(self, name: str, number: int | None = None) -> tuple[ModelRecord, list]:
        """Return a model and either one version or all of them."""
        validate_name(name)
        model = self.store.get_model(name)
        if number is None:
            return model, self.store.list_versions(name)
        return model, [self.store.get_version(name, number)]

    def pull(
        self, name: str, number: int | None, variant: str = ""
    ) -> tuple[VersionRecord, VariantRecord, Iterator[bytes]]:
        """Return a version, one variant of it, and its decrypted bytes as a stream."""
        validate_name(name)
        record = self.store.get_version(name, number)
        chosen = record.variant(variant or BASE_VARIANT)
        if chosen is None:
            have = ", ".join(v.name for v in record.variants)
            raise errors.NotFound(
                f"{name}:{record.number} has no variant {variant!r} (it has {have})"
            )
        data_key = self.kek.unwrap(record.data_key, context=record.uid)
        ciphertext = self.blobs.open_read(chosen.ciphertext_sha256)
        plaintext = decrypt_stream(
            data_key, ciphertext, associated_data=associated_data(record.uid, chosen.name)
        )
        return record, chosen, plaintext

    # -- keys ---------------------------------------------------------------------------

    def rotate_kek(self, new: KeyEncryptionKey) -> tuple[str, str, int]:
        """Re-wrap every data key under `new` (blobs untouched); returns old id, new id, count."""
        with self._kek_lock:
            old = self.kek
            count = self.store.rewrap_data_keys(
                lambda uid, wrapped: rewrap(wrapped, old=old, new=new, context=uid)
            )
            self.kek = new
            if isinstance(new, LocalKek):
                new.retire_old_keys()
        log.info("re-wrapped %d data keys from %s to %s", count, old.kek_id, new.kek_id)
        return old.kek_id, new.kek_id, count


def _manifest_variant(uid: str, v: VariantRecord) -> dict:
    return {
        "plaintext_sha256": v.plaintext_sha256,
        "plaintext_size": v.plaintext_size,
        "ciphertext_sha256": v.ciphertext_sha256,
        "ciphertext_size": v.ciphertext_size,
        "segment_size": v.segment_size,
        "aead": AEAD_NAME,
        "associated_data": associated_data(uid, v.name).decode(),
        "signature": v.signature,
    }
