"""The model registry: transport-free handlers behind the admin gRPC service.

A push spools the upload into a memfd, then (and only then: a stalled upload must not
keep others waiting) takes a push slot, converts and validates it with MNN in a child
process, derives variants, encrypts each under a fresh per-version data key, stores the
ciphertexts, and only then appends the version row. Anything that fails on the way
deletes what it stored, so no version exists without its blobs, no blob without its
version, and version numbers stay gapless.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import json
import logging
import mmap
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

from contract import chunks, errors
from contract.segments import SegmentHasher, encode_digests
from control_plane.blobs import BlobStore
from control_plane.crypto import (
    SEGMENT_SIZE,
    WrappedKey,
    decrypt_stream,
    encrypt_chunks,
    new_data_key,
)
from control_plane.crypto.kek_ring import KekRing
from control_plane.registry import chunking, evaluation, gc, llm_tools, mnn_tools, upload_spool
from control_plane.registry.contract import (
    BASE_VARIANT,
    LLM_DEFAULT_VARIANTS,
    LLM_FORMATS,
    MANIFEST_SCHEMA,
    misplaced_variants,
    variant_needs,
)
from control_plane.registry.duplicates import refuse_duplicate
from control_plane.registry.mnn_sandbox import Sandbox
from control_plane.registry.requests import (
    PushRequest,
    check_request,
    check_upload,
    validate_name,
    validate_version,
)
from control_plane.registry.signers import SigningKeys
from control_plane.store.base import (
    ModelRecord,
    NewVersion,
    RegistryStore,
    StaleKek,
    VariantRecord,
    VersionRecord,
    chunk_blobs,
    chunk_secret_context,
)

log = logging.getLogger(__name__)

AEAD_NAME = "AES256_GCM_HKDF_1MB"
# Concurrent MNN children per push; each holds a copy of a variant's weights.
INSPECT_WORKERS = 2
# What golden data's ciphertext is bound to in place of a variant name (variant names are
# fp16/int8/int4 only, so it cannot collide).
GOLDEN_LABEL = "golden"
# A variant's chunk key list is bound to "<variant>/chunk-keys" (associated data).
CHUNK_KEYS_LABEL = "chunk-keys"
# Times a push re-wraps its data key after a rotation on some replica switched the KEK.
STALE_KEK_RETRIES = 3
# Times a push checks again for a duplicate after other pushes of its model committed
# between its check and its commit.
DUPLICATE_RECHECKS = 5


class _LatestMoved(Exception):
    """Another push of the model committed after this one checked for a duplicate."""


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
        kek: KekRing,
        signer: SigningKeys,
        max_model_bytes: int,
        mnn_timeout_s: float,
        max_concurrent_pushes: int = 2,
        max_concurrent_uploads: int = 4,
        sandbox: Sandbox | None = None,
        gc_grace_s: float = 0,
        chunk_min_bytes: int = chunking.CHUNKED_MIN_BYTES,
    ) -> None:
        self.store, self.blobs, self.kek, self.signer = store, blobs, kek, signer
        self.max_model_bytes = max_model_bytes
        # Variants at least this big are stored as chunks too (0: none).
        if chunk_min_bytes < 0:
            raise errors.InvalidArgument(f"chunk_min_bytes must not be negative: {chunk_min_bytes}")
        self.chunk_min_bytes = chunk_min_bytes
        self._mnn_timeout = mnn_timeout_s
        self._sandbox = sandbox
        # 0: derived from the MNN timeout and the upload limit (registry/gc.py).
        self.gc_grace_s = gc_grace_s or gc.default_grace_s(
            mnn_timeout_s=mnn_timeout_s, max_model_bytes=max_model_bytes
        )
        # A push holds its model (and each variant) in RAM and runs MNN children; on a
        # small box, unbounded concurrent pushes of large models would exhaust memory.
        self._push_slots = threading.BoundedSemaphore(max(1, max_concurrent_pushes))
        # Every upload holds up to max_model_bytes of RAM from its first byte until its push
        # ends, and a slow client can make that last: their number is capped, the excess
        # refused at once rather than queued.
        self._max_uploads = max(1, max_concurrent_uploads)
        self._upload_slots = threading.BoundedSemaphore(self._max_uploads)

    # -- push -------------------------------------------------------------------------

    def push(self, request: PushRequest, chunks: Iterable[bytes]) -> VersionRecord:
        """Spool `chunks`, then validate, convert, encrypt and store them as the next version."""
        check_request(request)
        with self.upload_slot():
            upload = upload_spool.spool(chunks, limit=self.max_model_bytes)
            try:
                return self.push_spooled(request, upload)
            finally:
                os.close(upload.fd)

    @contextlib.contextmanager
    def upload_slot(self) -> Iterator[None]:
        """Hold an upload slot from the first byte until the push ends; Busy if none is free."""
        if not self._upload_slots.acquire(blocking=False):
            raise errors.Busy(
                f"{self._max_uploads} uploads are already in progress: try again later"
            )
        try:
            yield
        finally:
            self._upload_slots.release()

    def push_spooled(
        self,
        request: PushRequest,
        upload: upload_spool.Spooled,
        *,
        abandoned: Callable[[], bool] = lambda: False,
    ) -> VersionRecord:
        """Validate, convert, encrypt and store a spooled upload (the caller closes its fd).

        `abandoned` is asked once more just before the version commits: an upload whose
        client went away may have been cut short, and is never stored.
        """
        extra = check_request(request)
        check_upload(request, upload)
        self.latest_unless_duplicate(request, upload.sha256)  # before any MNN work
        request = replace(request, sha256=upload.sha256)
        stored: list[str] = []
        with self._push_slots, contextlib.ExitStack() as stack:
            try:
                fmt = mnn_tools.sniff_format(upload.fd)
                if (wrong := misplaced_variants(fmt, extra)) is not None:
                    raise errors.InvalidArgument(wrong)
                if fmt in LLM_FORMATS:
                    build = (
                        llm_tools.build_from_gguf if fmt == "gguf" else llm_tools.build_from_bundle
                    )
                    built = build(
                        upload.fd, extra or LLM_DEFAULT_VARIANTS, request, **self._mnn_limits()
                    )
                    stack.enter_context(built)
                    return self._store_version(
                        request, fmt, built.fds, stored, abandoned, judged=built
                    )
                fds = self._plaintext_variants(fmt, upload.fd, extra, stack)
                return self._store_version(request, fmt, fds, stored, abandoned)
            except BaseException:
                self._delete_blobs(stored)
                raise

    def latest_unless_duplicate(self, request: PushRequest, sha256: str) -> int:
        """Return the model's latest version number (0: none yet), refusing a duplicate.

        A push that would remake the latest version (the same source bytes, the same
        variants, and no pipeline on either) is refused (FailedPrecondition naming it)
        unless it says `allow_duplicate`: re-running a push must not make a second version
        nobody asked for. A push that asks for other variants or a pipeline is a new version.
        """
        try:
            latest = self.store.get_version(request.name, None)
        except errors.NotFound:
            return 0
        refuse_duplicate(latest, request, sha256)
        return latest.number

    def _plaintext_variants(
        self, fmt: str, upload_fd: int, extra: tuple[str, ...], stack: contextlib.ExitStack
    ) -> dict[str, int]:
        """Return a memfd per variant of an ONNX or MNN upload (fp32 first)."""
        base = upload_fd
        if fmt == "onnx":
            base = mnn_tools.convert_onnx(upload_fd, **self._mnn_limits())
            stack.callback(os.close, base)
        fds = {BASE_VARIANT: base}
        for name in extra:
            fds[name] = mnn_tools.make_variant(base, name, **self._mnn_limits())
            stack.callback(os.close, fds[name])
        return fds

    def _mnn_limits(self) -> dict:
        """Keyword arguments that bound every MNN child of a push."""
        return {"timeout": self._mnn_timeout, "sandbox": self._sandbox}

    def _store_version(
        self,
        request: PushRequest,
        fmt: str,
        fds: dict[str, int],
        stored: list[str],
        abandoned: Callable[[], bool],
        *,
        judged: llm_tools.LlmBuild | None = None,
    ) -> VersionRecord:
        """Encrypt and store every variant in `fds` (the base first), then add the version.

        `judged`: a language model's build, whose child already scored its variants
        against the reference; otherwise golden inputs are run here, beside encryption.
        """
        uid, data_key = uuid.uuid4().hex, new_data_key()
        base = next(iter(fds))
        secret, known = self._chunk_secret(request.name)
        first_write = time.monotonic()
        # MNN inspects and runs each variant in child processes while this thread encrypts
        # and stores: the two dominate a push, and neither needs the other's result until
        # the end. The coordinating thread only waits on the children.
        with (
            ThreadPoolExecutor(INSPECT_WORKERS, thread_name_prefix="skiff-inspect") as pool,
            ThreadPoolExecutor(1, thread_name_prefix="skiff-golden") as coordinator,
        ):
            running = None
            if judged is None:
                running = coordinator.submit(
                    evaluation.evaluate,
                    fds,
                    BASE_VARIANT,
                    request.golden,
                    pool=pool,
                    limits=self._mnn_limits(),
                )
            segments: dict[str, bytes] = {}
            sealed = [
                self._encrypt_variant(uid, n, fd, data_key, stored, segments)
                for n, fd in fds.items()
            ]
            found = running.result() if running is not None else judged.evaluation
        # Chunks once the variants passed their checks: a refused push writes none (they
        # are not deleted when a push fails later: see _chunk_variant).
        sealed = [
            replace(
                v,
                chunks=self._chunk_variant(
                    request.name,
                    uid,
                    v.name,
                    fds[v.name],
                    secret,
                    data_key,
                    stored,
                    known,
                    bundle=judged is not None,
                ),
            )
            for v in sealed
        ]
        signatures = found.signatures
        pipeline = _fitted_pipeline(request, signatures[base])
        variants = tuple(
            replace(
                v,
                signature=signatures[v.name],
                accuracy=found.accuracy.get(v.name, {}),
                degraded=found.degraded.get(v.name, False),
            )
            for v in sealed
        )
        golden_blob = self._encrypt_golden(uid, found.golden, data_key, stored)
        golden_blob["source"] = request.golden.source
        created_at = dt.datetime.now(dt.UTC).replace(microsecond=0)

        def build(wrapped: WrappedKey, number: int) -> NewVersion:
            # Garbage collection counts on every row committing within half its grace
            # period of its first blob (registry/gc.py): past that, fail instead.
            if time.monotonic() - first_write > self.gc_grace_s / 2:
                raise errors.Unavailable(
                    "push took longer than half the garbage-collection grace period "
                    f"({self.gc_grace_s:g} s): push again"
                )
            manifest = {
                "schema": MANIFEST_SCHEMA,
                "model": request.name,
                "version": number,
                "uid": uid,
                "created_at": created_at.isoformat(),
                "source_format": fmt,
                "source_sha256": request.sha256,  # what was pushed: duplicates are refused
                "signature": signatures[base],
                "variants": {v.name: _manifest_variant(uid, v, segments[v.name]) for v in variants},
                "golden": golden_blob,
            }
            if judged is not None:
                # What kind of model, and what each variant needs of a device to fit it.
                manifest["llm"] = judged.llm
                for name, needs in judged.requirements.items():
                    manifest["variants"][name]["requirements"] = needs
            else:
                # A tensor model's needs as far as they are known without a device: its
                # size on disk and the MNN that made it (an older runtime may not read
                # it). Memory is the device's to measure (its probe): not stated.
                for v in variants:
                    manifest["variants"][v.name]["requirements"] = _tensor_needs(v)
            if pipeline is not None:
                manifest["pipeline"] = pipeline
            signed = self.signer.sign(manifest)
            return NewVersion(
                uid=uid,
                created_at=created_at,
                created_by=request.actor,
                notes=request.notes,
                source_format=fmt,
                signature=signatures[base],
                variants=variants,
                data_key=wrapped,
                manifest=signed.body,
                manifest_signature=signed.signature,
                signing_key_id=signed.key_id,
                golden=golden_blob,
            )

        if abandoned():
            raise errors.Unavailable("client disconnected mid-upload")
        record = self._create_unless_duplicate(request, uid, data_key, secret, build)
        # A rotation on another replica may have committed while this push signed.
        if self.signer.settle(record.signing_key_id):
            record = self.store.get_version(record.model, record.number)
        log.info("pushed %s:%d (%s)", record.model, record.number, ", ".join(fds))
        return record

    def _create_unless_duplicate(
        self,
        request: PushRequest,
        uid: str,
        data_key: bytes,
        secret: bytes,
        build: Callable[[WrappedKey, int], NewVersion],
    ) -> VersionRecord:
        """Insert the version unless a push of the same bytes committed while this one ran.

        The check reads the latest version; the insert takes the next number under the
        model's lock. A number other than the one after what was checked means another push
        committed in between: check again against it.
        """
        for _ in range(DUPLICATE_RECHECKS):
            checked = self.latest_unless_duplicate(request, request.sha256)

            def unless_moved(wrapped: WrappedKey, number: int, seen: int = checked) -> NewVersion:
                if number != seen + 1 and not request.allow_duplicate:
                    raise _LatestMoved
                return build(wrapped, number)

            try:
                return self._create_version(request.name, uid, data_key, secret, unless_moved)
            except _LatestMoved:
                continue
        raise errors.Unavailable(
            f"other pushes of {request.name} kept committing while this one did: push again"
        )

    def _create_version(
        self,
        model: str,
        uid: str,
        data_key: bytes,
        secret: bytes,
        build: Callable[[WrappedKey, int], NewVersion],
    ) -> VersionRecord:
        """Insert the version with its data key and chunk secret wrapped under the active KEK."""
        for attempt in range(STALE_KEK_RETRIES + 1):
            # Wrapped before the store's transaction opens: a KMS call can take seconds.
            wrapped = self.kek.wrap(data_key, context=uid)
            wrapped_secret = self.kek.wrap(secret, context=chunk_secret_context(uid))

            def with_secret(number: int, wrapped=wrapped, wrapped_secret=wrapped_secret):
                return replace(build(wrapped, number), chunk_secret=wrapped_secret)

            try:
                if wrapped_secret.kek_id != wrapped.kek_id:  # a rotation between the two
                    raise StaleKek("the active KEK changed while the keys were wrapped")
                return self.store.create_version(model, with_secret)
            except StaleKek:
                # A rotation (on any replica) switched the KEK since this process looked.
                if attempt == STALE_KEK_RETRIES:
                    raise
                self.kek.reload()
        raise AssertionError("unreachable")

    def _encrypt_variant(
        self,
        uid: str,
        name: str,
        fd: int,
        data_key: bytes,
        stored: list[str],
        segments: dict[str, bytes],
    ) -> VariantRecord:
        """Encrypt one plaintext memfd into the blob store, hashing it on the way.

        The ciphertext's per-segment digests go to `segments[name]` (for the manifest).
        """
        digest, size = hashlib.sha256(), 0

        def plaintext() -> Iterator[bytes]:
            nonlocal size
            for chunk in upload_spool.read_chunks(fd):
                digest.update(chunk)
                size += len(chunk)
                yield chunk

        # Straight from memory into the blob store: only ciphertext is ever written.
        ciphertext = encrypt_chunks(
            data_key, plaintext(), associated_data=associated_data(uid, name)
        )
        hasher = SegmentHasher()
        info = self.blobs.put_stream(hasher.wrap(ciphertext))
        stored.append(info.key)
        segments[name] = hasher.digests()
        return VariantRecord(
            name=name,
            plaintext_size=size,
            plaintext_sha256=digest.hexdigest(),
            ciphertext_size=info.size,
            ciphertext_sha256=info.key,
            segment_size=SEGMENT_SIZE,
            signature={},
        )

    def _chunk_secret(self, model: str) -> tuple[bytes, set[str]]:
        """Return the model's chunk secret and the blobs its committed versions name.

        A model's first version makes a new secret; the blobs named already are not
        stored again.
        """
        try:
            versions = self.store.list_versions(model)
        except errors.NotFound:
            return chunks.new_secret(), set()
        known: set[str] = set()
        for v in versions:
            for variant in v.variants:
                known |= chunk_blobs(variant.chunks)
        latest = next((v for v in reversed(versions) if v.chunk_secret is not None), None)
        if latest is None:
            return chunks.new_secret(), known
        secret = self.kek.unwrap(latest.chunk_secret, context=chunk_secret_context(latest.uid))
        return secret, known

    def _chunk_variant(
        self,
        model: str,
        uid: str,
        name: str,
        fd: int,
        secret: bytes,
        data_key: bytes,
        stored: list[str],
        known: set[str],
        *,
        bundle: bool,
    ) -> dict:
        """Cut a variant's plaintext into chunks, store the new ones; return its chunk record.

        A chunk the model's committed versions already name (and the store still holds)
        is not stored again; any other is written (again), which refreshes its age for the
        garbage collector: an orphan left by a failed push is reused only once rewritten.
        Chunks are never deleted when this push fails (another push of the model may share
        them): the collector takes the unreferenced ones once they are old. The key list is this
        version's alone, encrypted under its data key, and goes with the push.
        """
        size = os.fstat(fd).st_size
        if not self.chunk_min_bytes or size < self.chunk_min_bytes:
            return {}
        spans: list[int] = []
        if bundle:
            with open(f"/proc/self/fd/{fd}", "rb") as f:
                spans = chunking.tar_spans(f)
        refs, keys = [], []
        with contextlib.ExitStack() as stack:
            mapped = stack.enter_context(mmap.mmap(fd, size, prot=mmap.PROT_READ))
            view = stack.enter_context(memoryview(mapped))
            for sealed in chunking.seal(secret, model, view, spans=spans):
                refs.append(sealed.ref)
                keys.append(sealed.key)
                name = sealed.ref.id.hex()
                # A chunk a committed version names is skipped only while the store still
                # has it: one lost (a sweep's race, an operator, a lifecycle rule) is put
                # back by the next push of the model instead of staying lost.
                if name not in known or not self.blobs.exists(name):
                    info = self.blobs.put_stream(iter((sealed.ciphertext,)), refresh=True)
                    known.add(info.key)
        table = chunks.ChunkTable(tuple(refs))
        packed = chunks.pack_keys(keys)
        label = f"{name}/{CHUNK_KEYS_LABEL}"
        return {
            "table": table.to_manifest(),
            "keys": self._encrypt_small(uid, label, packed, data_key, stored),
        }

    def _encrypt_golden(self, uid: str, data: bytes, data_key: bytes, stored: list[str]) -> dict:
        """Encrypt the golden data under the version's data key; return its blob record."""
        return self._encrypt_small(uid, GOLDEN_LABEL, data, data_key, stored)

    def _encrypt_small(
        self, uid: str, label: str, data: bytes, data_key: bytes, stored: list[str]
    ) -> dict:
        """Encrypt a version's small blob (bound to `label`); return its blob record."""
        ad = associated_data(uid, label)
        info = self.blobs.put_stream(encrypt_chunks(data_key, iter((data,)), associated_data=ad))
        stored.append(info.key)
        return {
            "ciphertext_sha256": info.key,
            "ciphertext_size": info.size,
            "plaintext_sha256": hashlib.sha256(data).hexdigest(),
            "plaintext_size": len(data),
            "segment_size": SEGMENT_SIZE,
            "associated_data": ad.decode(),
        }

    def _delete_blobs(self, keys: list[str]) -> None:
        for key in keys:
            try:
                self.blobs.delete(key)
            except errors.SkiffError as exc:
                # Left for a later sweep; the version row was never written.
                log.warning("could not delete blob %s after a failed push: %s", key, exc)

    # -- read ---------------------------------------------------------------------------

    def list_models(self, *, after: str = "", limit: int | None = None) -> list[ModelRecord]:
        """Return models by name: those after `after` (a page token's key), at most `limit`."""
        if after:
            validate_name(after)
        return self.store.list_models(after=after, limit=limit)

    def show(
        self, name: str, number: int | None = None, *, after: int = 0, limit: int | None = None
    ) -> tuple[ModelRecord, list]:
        """Return a model and either one version or its versions after `after` (at most `limit`)."""
        validate_name(name)
        validate_version(number)
        model = self.store.get_model(name)
        if number is None:
            return model, self.store.list_versions(name, after=after, limit=limit)
        return model, [self.store.get_version(name, number)]

    def pull(
        self, name: str, number: int | None, variant: str = ""
    ) -> tuple[VersionRecord, VariantRecord, Iterator[bytes]]:
        """Return a version, one variant of it, and its decrypted bytes as a stream."""
        validate_name(name)
        validate_version(number)
        record = self.store.get_version(name, number)
        chosen = record.variant(variant or BASE_VARIANT)
        if chosen is None:
            have = ", ".join(v.name for v in record.variants)
            raise errors.NotFound(
                f"{name}:{record.number} has no variant {variant!r:.40} (it has {have})"
            )
        data_key = self.kek.unwrap(record.data_key, context=record.uid)
        ciphertext = self.blobs.open_read(chosen.ciphertext_sha256)
        plaintext = decrypt_stream(
            data_key, ciphertext, associated_data=associated_data(record.uid, chosen.name)
        )
        return record, chosen, plaintext

    def variant_needs(self, name: str, number: int, variant: str) -> dict:
        """Return what a variant needs of a device, as its signed manifest says ({}: nothing).

        A version that is gone (or unreadable) needs nothing here: its rollout fails
        elsewhere, not in device fit.
        """
        try:
            manifest = json.loads(self.store.get_version(name, number).manifest)
        except (errors.NotFound, ValueError):
            return {}
        return variant_needs(manifest, variant) if isinstance(manifest, dict) else {}

    def golden(self, name: str, number: int | None) -> tuple[VersionRecord, bytes]:
        """Return a version and its decrypted golden data (runtime.golden's .npz)."""
        validate_name(name)
        validate_version(number)
        record = self.store.get_version(name, number)
        blob = record.golden
        if not blob:
            raise errors.NotFound(
                f"{name}:{record.number} has no golden data (pushed before golden data existed)"
            )
        data_key = self.kek.unwrap(record.data_key, context=record.uid)
        data = b"".join(
            decrypt_stream(
                data_key,
                self.blobs.open_read(blob["ciphertext_sha256"]),
                associated_data=associated_data(record.uid, GOLDEN_LABEL),
            )
        )
        if hashlib.sha256(data).hexdigest() != blob["plaintext_sha256"]:
            raise errors.IntegrityError(f"{name}:{record.number}: golden data does not match")
        return record, data

    # -- garbage ------------------------------------------------------------------------

    def collect_garbage(self, *, dry_run: bool = False) -> gc.GcResult:
        """Delete blobs no version references that are older than the grace period."""
        return gc.collect_garbage(self.store, self.blobs, grace_s=self.gc_grace_s, dry_run=dry_run)


def _manifest_variant(uid: str, v: VariantRecord, segments: bytes) -> dict:
    return {
        "segment_sha256": encode_digests(segments),
        "plaintext_sha256": v.plaintext_sha256,
        "plaintext_size": v.plaintext_size,
        "ciphertext_sha256": v.ciphertext_sha256,
        "ciphertext_size": v.ciphertext_size,
        "segment_size": v.segment_size,
        "aead": AEAD_NAME,
        "associated_data": associated_data(uid, v.name).decode(),
        "signature": v.signature,
        "accuracy": v.accuracy,
        "degraded": v.degraded,
        **({"chunks": v.chunks} if v.chunks else {}),
    }


def _tensor_needs(v: VariantRecord) -> dict:
    """Return what a tensor model's variant needs of a device (control_plane.rollouts.fit)."""
    needs: dict = {"disk_mb": -(-v.plaintext_size // (1 << 20))}
    mnn = str(v.signature.get("mnn_version") or "")
    if mnn.count(".") >= 1:
        needs["mnn"] = ".".join(mnn.split(".")[:2])
    return needs


def _fitted_pipeline(request: PushRequest, signature: dict) -> dict | None:
    """Return the request's pipeline as manifest JSON once it fits the model's input."""
    if request.pipeline is None:
        return None
    from runtime.pipeline_spec import PipelineError

    try:
        request.pipeline.fit(signature.get("inputs", []))
    except PipelineError as exc:
        raise errors.InvalidArgument(f"pipeline does not fit {request.name}: {exc}") from None
    return request.pipeline.to_json()
