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
import logging
import os
import re
import tempfile
import threading
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from control_plane import errors, memfd, mnn_tools
from control_plane.blobs import BlobStore
from control_plane.crypto import (
    SEGMENT_SIZE,
    KeyEncryptionKey,
    LocalKek,
    ManifestSigner,
    decrypt_stream,
    encrypt_stream,
    new_data_key,
    rewrap,
)
from control_plane.store.base import (
    ModelRecord,
    NewVersion,
    RegistryStore,
    VariantRecord,
    VersionRecord,
)

log = logging.getLogger(__name__)

MODEL_NAME = re.compile(r"[a-z0-9_-]{1,64}")
BASE_VARIANT = "fp32"
AEAD_NAME = "AES256_GCM_HKDF_1MB"
MANIFEST_SCHEMA = "skiff.manifest/v1"


@dataclass(frozen=True)
class PushRequest:
    """What a caller asks for when pushing a model."""

    name: str
    actor: str
    notes: str = ""
    variants: tuple[str, ...] = ()
    filename: str = ""


def validate_name(name: str) -> str:
    """Return a valid model name or raise InvalidArgument naming the rule."""
    if not MODEL_NAME.fullmatch(name or ""):
        raise errors.InvalidArgument(
            f"invalid model name {name!r}: use 1-64 of lowercase letters, digits, '-', '_'"
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
        signer: ManifestSigner,
        staging_dir: Path,
        max_model_bytes: int,
        mnn_timeout_s: float,
    ) -> None:
        self.store, self.blobs, self.kek, self.signer = store, blobs, kek, signer
        self._staging = Path(staging_dir)
        self._staging.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.max_model_bytes = max_model_bytes
        self._mnn_timeout = mnn_timeout_s
        # Held from wrapping a data key until its row commits, and for a whole rotation,
        # so a rotation never misses a key wrapped under the KEK it is retiring. (One
        # process; replicas rotating concurrently would need a database lock.)
        self._kek_lock = threading.Lock()

    # -- push -------------------------------------------------------------------------

    def push(self, request: PushRequest, chunks: Iterable[bytes]) -> VersionRecord:
        """Validate, convert, encrypt and store a model as the next version."""
        validate_name(request.name)
        extra = _validate_variants(request.variants)
        stored: list[str] = []
        with contextlib.ExitStack() as fds:
            upload = memfd.spool(chunks, limit=self.max_model_bytes)
            fds.callback(os.close, upload.fd)
            if upload.size == 0:
                raise errors.InvalidArgument("model file is empty")
            try:
                plain = self._plaintext_variants(upload.fd, extra, fds)
                return self._store_version(request, plain, stored)
            except BaseException:
                self._delete_blobs(stored)
                raise

    def _plaintext_variants(
        self, upload_fd: int, extra: tuple[str, ...], fds: contextlib.ExitStack
    ) -> dict[str, tuple[int, str, mnn_tools.ModelSignature]]:
        """Return {variant: (memfd, source format, signature)}, each loaded by MNN."""
        fmt = mnn_tools.sniff_format(upload_fd)
        base = upload_fd
        if fmt == "onnx":
            base = mnn_tools.convert_onnx(upload_fd, timeout=self._mnn_timeout)
            fds.callback(os.close, base)
        plain = {BASE_VARIANT: (base, fmt)}
        for name in extra:
            fd = mnn_tools.make_variant(base, name, timeout=self._mnn_timeout)
            fds.callback(os.close, fd)
            plain[name] = (fd, fmt)
        return {
            name: (fd, fmt, mnn_tools.inspect_model(fd, timeout=self._mnn_timeout))
            for name, (fd, fmt) in plain.items()
        }

    def _store_version(self, request: PushRequest, plain: dict, stored: list[str]):
        uid = uuid.uuid4().hex
        data_key = new_data_key()
        variants = []
        for name, (fd, _fmt, signature) in plain.items():
            variants.append(self._encrypt_variant(uid, name, fd, signature, data_key, stored))
        base_signature = plain[BASE_VARIANT][2].to_dict()
        created_at = dt.datetime.now(dt.UTC).replace(microsecond=0)

        def build(number: int) -> NewVersion:
            manifest = {
                "schema": MANIFEST_SCHEMA,
                "model": request.name,
                "version": number,
                "uid": uid,
                "created_at": created_at.isoformat(),
                "source_format": plain[BASE_VARIANT][1],
                "signature": base_signature,
                "variants": {v.name: _manifest_variant(uid, v) for v in variants},
            }
            signed = self.signer.sign(manifest)
            return NewVersion(
                uid=uid,
                created_at=created_at,
                created_by=request.actor,
                notes=request.notes,
                source_format=plain[BASE_VARIANT][1],
                signature=base_signature,
                variants=tuple(variants),
                data_key=self.kek.wrap(data_key, context=uid),
                manifest=signed.body,
                manifest_signature=signed.signature,
                signing_key_id=signed.key_id,
            )

        with self._kek_lock:
            record = self.store.create_version(request.name, build)
        log.info("pushed %s:%d (%s)", record.model, record.number, ", ".join(plain))
        return record

    def _encrypt_variant(self, uid, name, fd, signature, data_key, stored) -> VariantRecord:
        plain = memfd.stat_fd(fd)
        # Only ciphertext is ever written to disk.
        with tempfile.NamedTemporaryFile(dir=self._staging, prefix="enc-") as tmp:
            encrypt_stream(
                data_key, memfd.read_chunks(fd), tmp, associated_data=associated_data(uid, name)
            )
            tmp.flush()
            info = self.blobs.put_file(tmp.name)
        stored.append(info.key)
        return VariantRecord(
            name=name,
            plaintext_size=plain.size,
            plaintext_sha256=plain.sha256,
            ciphertext_size=info.size,
            ciphertext_sha256=info.key,
            segment_size=SEGMENT_SIZE,
            signature=signature.to_dict(),
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
