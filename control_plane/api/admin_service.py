"""AdminService servicer: authenticates, converts messages, calls the registry."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from dataclasses import replace

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from contract import errors
from control_plane import paging
from control_plane.api.access import caller
from control_plane.api.auth import ApiTokens, Authenticator
from control_plane.api.golden_convert import accuracy_pb, golden_pb, golden_request
from control_plane.api.grpc_errors import mapped, mapped_async, mapped_async_stream
from control_plane.api.read_ahead import Reader, read_ahead
from control_plane.api.signing_convert import chain_pb, signing_key_pb
from control_plane.registry import upload_spool
from control_plane.registry.contract import MAX_GOLDEN_UPLOAD
from control_plane.registry.kek_rotation import KekRotation
from control_plane.registry.registry import Registry
from control_plane.registry.requests import (
    PushRequest,
    check_request,
    parse_pipeline,
    validate_name,
    validate_positive_version,
)
from control_plane.store.base import ModelRecord, VariantRecord, VersionRecord
from protos import admin_pb2, admin_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

PULL_CHUNK = 1 << 20
# A pull checks its token again every this many chunks (MiB): a revocation stops it.
RECHECK_CHUNKS = 64


def _timestamp(value) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def signature_pb(sig: dict) -> common_pb2.ModelSignature:
    """Convert a stored signature dict to its message."""
    llm = sig.get("llm")
    return common_pb2.ModelSignature(
        inputs=[common_pb2.TensorSpec(**t) for t in sig.get("inputs", [])],
        outputs=[common_pb2.TensorSpec(**t) for t in sig.get("outputs", [])],
        mnn_version=sig.get("mnn_version", ""),
        llm=common_pb2.LlmSignature(**llm) if llm else None,
    )


def variant_pb(v: VariantRecord) -> common_pb2.Variant:
    """Convert a variant record to its message."""
    return common_pb2.Variant(
        name=v.name,
        plaintext_size=v.plaintext_size,
        plaintext_sha256=v.plaintext_sha256,
        ciphertext_size=v.ciphertext_size,
        ciphertext_sha256=v.ciphertext_sha256,
        segment_size=v.segment_size,
        signature=signature_pb(v.signature),
        accuracy=accuracy_pb(v.accuracy),
        degraded=v.degraded,
    )


def version_pb(r: VersionRecord) -> common_pb2.ModelVersion:
    """Convert a version record to its message."""
    return common_pb2.ModelVersion(
        model=r.model,
        version=r.number,
        created_at=_timestamp(r.created_at),
        created_by=r.created_by,
        notes=r.notes,
        source_format=r.source_format,
        signature=signature_pb(r.signature),
        variants=[variant_pb(v) for v in r.variants],
        manifest=r.manifest,
        manifest_signature=r.manifest_signature,
        signing_key_id=r.signing_key_id,
        golden=golden_pb(r.golden),
    )


def model_pb(m: ModelRecord) -> common_pb2.Model:
    """Convert a model record to its message."""
    return common_pb2.Model(
        name=m.name,
        created_at=_timestamp(m.created_at),
        latest_version=m.latest_version,
        version_count=m.version_count,
    )


class _Upload:
    """The chunk stream of a PushModel call, read without holding a thread or a push slot.

    A client that sends nothing for `idle_timeout` seconds is cut off, so a stalled
    upload cannot keep its upload slot (and its RAM) for ever.
    """

    def __init__(self, requests: AsyncIterator, idle_timeout: float) -> None:
        self._requests = aiter(requests)
        self._idle_timeout = idle_timeout
        self.what = "a push"  # named once its header is read
        self.size = self.received = 0
        # Set once the push's thread owns the upload (it, not the call, logs its end).
        self.handed_over = False

    def progress(self) -> str:
        """Say how far the upload got, for a log line."""
        if not self.size:
            return "before its upload"
        if self.received >= self.size:  # the client reset the call as its last bytes came
            return f"as its upload ended ({_mib(self.size)} MiB received)"
        return f"mid-upload ({_mib(self.received)} of {_mib(self.size)} MiB received)"

    async def header(self, limit: int) -> admin_pb2.PushHeader:
        """Read the first message, which must be the header; check its declared size."""
        first = await self._next()
        if first is None or first.WhichOneof("item") != "header":
            raise errors.InvalidArgument("PushModel: the first message must be a header")
        self.what, self.size = f"push of {first.header.name!r}", first.header.size
        if first.header.size > limit:
            raise errors.TooLarge(
                f"model is {first.header.size} bytes, over the {limit}-byte limit"
            )
        if first.header.golden_size < 0:
            raise errors.InvalidArgument(
                f"declared golden size {first.header.golden_size} is negative"
            )
        if first.header.golden_size > MAX_GOLDEN_UPLOAD:
            raise errors.TooLarge(
                f"golden inputs of {first.header.golden_size} bytes: the limit is "
                f"{MAX_GOLDEN_UPLOAD} bytes"
            )
        return first.header

    async def golden(self, size: int) -> tuple[bytes, admin_pb2.PushModelRequest | None]:
        """Read exactly `size` bytes of golden_chunk messages; return them and what follows."""
        golden = bytearray()
        while (request := await self._next()) is not None:
            if request.WhichOneof("item") != "golden_chunk":
                break
            golden += request.golden_chunk
            if len(golden) > size:
                raise errors.InvalidArgument(
                    f"PushModel: more golden bytes than the {size} the header declared"
                )
        if len(golden) != size:
            raise errors.InvalidArgument(
                f"PushModel: {len(golden)} golden bytes, the header declared {size}"
            )
        return bytes(golden), request

    async def spool(
        self, limit: int, first: admin_pb2.PushModelRequest | None
    ) -> upload_spool.Spooled:
        """Copy the remaining chunks into a memfd (hashing in a thread, off the event loop)."""
        spooler = upload_spool.Spooler(limit=limit)
        writing: asyncio.Future | None = None
        try:
            request = first
            while request is not None:
                if request.WhichOneof("item") != "chunk":
                    raise errors.InvalidArgument(
                        "PushModel: a header, then golden chunks, then model chunks"
                    )
                # Shielded: a cancelled call must not close the memfd under a write that
                # is still running in its thread (the fd number could be reused).
                writing = asyncio.ensure_future(asyncio.to_thread(spooler.write, request.chunk))
                await asyncio.shield(writing)
                self.received += len(request.chunk)
                request = await self._next()
            return spooler.finish()
        except BaseException:
            _when_done(writing, spooler.discard)
            raise

    async def _next(self):
        try:
            return await asyncio.wait_for(anext(self._requests, None), self._idle_timeout)
        except TimeoutError:
            raise errors.Unavailable(
                f"upload idle for {self._idle_timeout:g} s (upload_idle_timeout_s): cut off"
            ) from None


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f}"


def _when_done(future: asyncio.Future | None, cleanup: Callable[[], None]) -> None:
    """Run `cleanup` now, or once the thread behind `future` is done with what it holds."""
    if future is None or future.done():
        cleanup()
        return

    def done(f: asyncio.Future) -> None:
        if not f.cancelled():
            f.exception()  # the call already failed: this write's outcome is moot
        cleanup()

    future.add_done_callback(done)


def _log_abandoned(what: str, push: asyncio.Future) -> None:
    """Log, in one line, how a push whose call was cancelled ended in its thread."""
    exc = push.exception()
    if exc is None:
        record = push.result()
        log.warning(
            "%s was stored as %s:%d, but its client went away before hearing so",
            what,
            record.model,
            record.number,
        )
    elif isinstance(exc, errors.Unavailable):  # what `abandoned` raises, before the commit
        log.info("%s cancelled while the server checked it: nothing stored", what)
    elif isinstance(exc, errors.SkiffError):
        log.info("%s cancelled; nothing stored (it had failed anyway: %s)", what, exc)
    else:
        log.error("%s cancelled, then failed: %s: %s", what, type(exc).__name__, exc)


def _push_and_release(
    registry: Registry,
    request: PushRequest,
    upload: upload_spool.Spooled,
    owned: ExitStack,
    abandoned: threading.Event,
) -> VersionRecord:
    """Run the push in a worker thread, which then owns the upload's memfd and slot.

    A cancelled call stops awaiting this, but the thread carries on: it, not the
    coroutine, must close the memfd and free the slot once MNN is done with them.
    """
    with owned:
        return registry.push_spooled(request, upload, abandoned=abandoned.is_set)


def api_token_pb(t) -> admin_pb2.ApiToken:
    """Convert a token record to its message (never the hash)."""
    message = admin_pb2.ApiToken(
        id=t.id,
        name=t.name,
        role=t.role,
        created_at=_timestamp(t.created_at),
        created_by=t.created_by,
    )
    if t.expires_at is not None:
        message.expires_at.CopyFrom(_timestamp(t.expires_at))
    if t.revoked_at is not None:
        message.revoked_at.CopyFrom(_timestamp(t.revoked_at))
    return message


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Thin gRPC adapter over the registry and API tokens.

    Who may call what is decided before a handler runs (`access.AccessInterceptor`).
    """

    def __init__(
        self,
        registry: Registry,
        tokens: ApiTokens,
        auth: Authenticator,
        *,
        kek_rotation: KekRotation,
        upload_idle_timeout_s: float = 60.0,
    ):
        self._registry = registry
        self._tokens, self._auth = tokens, auth
        self._kek_rotation = kek_rotation
        self._idle_timeout = upload_idle_timeout_s

    def _recheck(self) -> None:
        """Refuse to go on with a long call whose token was revoked since it started."""
        self._auth.recheck(caller())

    def _actor(self, context: grpc.ServicerContext) -> str:
        """Return the name of the caller's token (authenticated by the interceptor)."""
        return caller().name

    @mapped_async
    async def PushModel(self, request_iterator, context):  # noqa: D102, N802
        # A client that goes away (cancels, drops the connection) ends the call, which runs
        # its done-callbacks, and may cancel this coroutine. The stream it cut short can
        # look complete, so either sign tells the push to store nothing.
        abandoned = threading.Event()
        context.add_done_callback(lambda _: abandoned.set())
        actor = self._actor(context)  # a contextvar read: no need for a thread
        upload = _Upload(request_iterator, self._idle_timeout)
        try:
            return await self._push(upload, actor, context, abandoned)
        except asyncio.CancelledError:
            if not upload.handed_over:  # else the push's thread says how it ended
                log.info("%s cancelled %s: nothing stored", upload.what, upload.progress())
            raise

    async def _push(self, upload: _Upload, actor: str, context, abandoned: threading.Event):
        limit = self._registry.max_model_bytes
        header = await upload.header(limit)
        request = PushRequest(
            name=header.name,
            actor=actor,
            notes=header.notes,
            variants=tuple(header.variants),
            filename=header.filename,
            size=header.size,
            sha256=header.sha256,
            golden=golden_request(header, b""),
            pipeline=parse_pipeline(header.pipeline),
            allow_duplicate=header.allow_duplicate,
        )
        check_request(request)
        # A declared digest lets a duplicate be refused before a byte of it is uploaded.
        await asyncio.to_thread(self._registry.latest_unless_duplicate, request, header.sha256)
        with ExitStack() as stack:
            # Spool first, under an upload slot only: the push slot is taken once every
            # byte is here, so stalled uploads cannot keep other pushes waiting.
            stack.enter_context(self._registry.upload_slot())
            golden, first = await upload.golden(header.golden_size)
            request = replace(request, golden=replace(request.golden, golden=golden))
            spooled = await upload.spool(limit, first)
            # An upload may take long: a token revoked meanwhile stores nothing.
            await asyncio.to_thread(self._recheck)
            # Send the response headers now: on a stream the client reset after it looked
            # complete, this is what makes the reset surface (and the done-callback run)
            # before the push commits. Clients that declare size and SHA-256, as the CLI
            # does, are checked exactly whatever the timing.
            stack.callback(os.close, spooled.fd)
            try:
                await context.send_initial_metadata(())
            except Exception:  # noqa: BLE001 - gRPC's ExecuteBatchError: the stream is gone
                # The client reset the call as its last bytes arrived: nobody can get an
                # answer, so it ends as a cancel does (one line, nothing stored).
                raise asyncio.CancelledError from None
            owned = stack.pop_all()
        # The push is shielded: its thread, once started, owns the slot and memfd and must
        # be the one to release them.
        push = asyncio.ensure_future(
            asyncio.to_thread(_push_and_release, self._registry, request, spooled, owned, abandoned)
        )
        upload.handed_over = True
        try:
            record = await asyncio.shield(push)
        except asyncio.CancelledError:
            abandoned.set()
            # Nobody awaits the push any more: its outcome is logged here, in one line,
            # rather than left for asyncio to report as an unretrieved exception.
            push.add_done_callback(functools.partial(_log_abandoned, upload.what))
            raise
        return version_pb(record)

    @mapped
    def ListModels(self, request, context):  # noqa: D102, N802
        self._actor(context)
        page = paging.page_request(
            request.page_size, request.page_token, scope="models", parse_key=validate_name
        )
        records = self._registry.list_models(after=page.after or "", limit=page.size + 1)
        models, token = paging.next_page(records, page, key=lambda m: m.name)
        return admin_pb2.ListModelsResponse(
            models=[model_pb(m) for m in models], next_page_token=token
        )

    @mapped
    def GetModel(self, request, context):  # noqa: D102, N802
        self._actor(context)
        page = paging.page_request(
            request.page_size,
            request.page_token,
            scope=f"versions:{request.name}",
            parse_key=validate_positive_version,
        )
        model, records = self._registry.show(
            request.name, request.version or None, after=page.after or 0, limit=page.size + 1
        )
        versions, token = paging.next_page(
            [version_pb(v) for v in records],
            page,
            key=lambda v: v.version,
            byte_size=lambda v: v.ByteSize(),
        )
        return admin_pb2.GetModelResponse(
            model=model_pb(model), versions=versions, next_page_token=token
        )

    def _open_pull(self, request) -> tuple[admin_pb2.PullHeader, Iterator[bytes]]:
        """Return the pull's header and its plaintext chunks (blocking: run in a thread)."""
        if request.golden:
            if request.variant:
                raise errors.InvalidArgument("pull either a variant or the golden data, not both")
            record, data = self._registry.golden(request.name, request.version or None)
            header = admin_pb2.PullHeader(version=version_pb(record))
            return header, (data[i : i + PULL_CHUNK] for i in range(0, len(data), PULL_CHUNK))
        record, variant, plaintext = self._registry.pull(
            request.name, request.version or None, request.variant
        )
        return admin_pb2.PullHeader(
            version=version_pb(record), variant=variant_pb(variant)
        ), plaintext

    # On the event loop, not a handler thread: a client that stops reading (or goes away)
    # cancels this coroutine at its next yield, where a thread blocked on flow control
    # stayed blocked, and a server stop could not get it back.
    @mapped_async_stream
    async def PullModel(self, request, context):  # noqa: D102, N802
        self._actor(context)
        header, plaintext = await asyncio.to_thread(self._open_pull, request)
        reader, sent = Reader(plaintext), 0

        def read() -> admin_pb2.PullModelResponse | None:
            chunk = reader.next()
            return None if chunk is None else admin_pb2.PullModelResponse(chunk=chunk)

        # Each piece is decrypted in a thread while the one before it (first, the header)
        # is sent.
        first = admin_pb2.PullModelResponse(header=header)
        async with contextlib.aclosing(read_ahead(first, read, reader.close)) as responses:
            async for response in responses:
                sent += 1
                if sent % RECHECK_CHUNKS == 0:
                    await asyncio.to_thread(self._recheck)
                yield response

    @mapped
    def RotateKek(self, request, context):  # noqa: D102, N802
        self._actor(context)
        r = self._kek_rotation.run(request.new_kek)
        return admin_pb2.RotateKekResponse(
            old_kek_id=r.old_kek_id, new_kek_id=r.new_kek_id, rewrapped=r.rewrapped
        )

    @mapped
    def CreateApiToken(self, request, context):  # noqa: D102, N802
        made = self._tokens.create(
            role=request.role, name=request.name, ttl_s=request.ttl_s, actor=self._actor(context)
        )
        return admin_pb2.CreateApiTokenResponse(token=api_token_pb(made.record), secret=made.secret)

    @mapped
    def ListApiTokens(self, request, context):  # noqa: D102, N802
        tokens = self._tokens.list(include_inactive=request.all)
        return admin_pb2.ListApiTokensResponse(tokens=[api_token_pb(t) for t in tokens])

    @mapped
    def RevokeApiToken(self, request, context):  # noqa: D102, N802
        return api_token_pb(self._tokens.revoke(request.id))

    @mapped
    def CollectGarbage(self, request, context):  # noqa: D102, N802
        self._actor(context)
        result = self._registry.collect_garbage(dry_run=request.dry_run)
        return admin_pb2.CollectGarbageResponse(
            blobs=result.blobs, bytes=result.bytes, kept_young=result.kept_young
        )

    @mapped
    def GetSigningKeys(self, request, context):  # noqa: D102, N802
        self._actor(context)
        return admin_pb2.GetSigningKeysResponse(
            keys=chain_pb(self._registry.signer.chain(fresh=True))
        )

    @mapped
    def RotateSigningKey(self, request, context):  # noqa: D102, N802
        self._actor(context)
        previous, active, _ = self._registry.signer.rotate(request.new_key, request.overlap_s)
        return admin_pb2.RotateSigningKeyResponse(
            previous=signing_key_pb(previous, active=False),
            active=signing_key_pb(active, active=True),
        )
