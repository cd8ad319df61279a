"""DeviceService: what agents call. Thin: authenticate, convert, call the domain.

Runs on the asyncio server. Sync, Watch and Download are coroutines so thousands of idle
Watch streams cost no threads; Enroll writes to the database and runs in the thread pool.
A device counts as synced to a version only once it acknowledged (Ack) the signed answer
naming it, never merely because Sync answered: a device may refuse an answer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import threading

from contract import errors
from contract.chunks import MAX_CHUNKS_PER_CALL
from control_plane.api.coalesce import Coalesced
from control_plane.api.fleet_convert import attributes_dict, states, timestamp
from control_plane.api.grpc_errors import mapped, mapped_async, mapped_async_stream
from control_plane.api.read_ahead import Reader, read_ahead
from control_plane.api.signing_convert import chain_pb
from control_plane.api.telemetry_convert import report_batch
from control_plane.api.throttle import Throttle, peer_key
from control_plane.api.throttle import enroll_throttle as new_enroll_throttle
from control_plane.blobs.base import CHUNK_SIZE
from control_plane.fleet.devices import Fleet
from control_plane.fleet.writer import DeviceWriter
from control_plane.registry.registry import associated_data
from control_plane.registry.requests import MAX_VERSION, VARIANT_NAME, validate_name
from control_plane.registry.signers import SigningKeys
from control_plane.rollouts.delivery import Assignment, Delivery, NotCached, SyncResult
from control_plane.rollouts.watchers import Watchers, fingerprint
from control_plane.store.fleet import DeviceAuth, DeviceUpdate, FleetStore, ModelState
from control_plane.store.report_records import ReportBatch
from control_plane.telemetry import Telemetry
from control_plane.telemetry.recommend import Recommendations, Stale
from protos import device_pb2, device_pb2_grpc

MAX_INSTALLED = 256
# Reports and Syncs up to this size are answered on the event loop (well under a
# millisecond); a bigger one (up to 256 models with 64 crashes each) in a thread, not to
# stall the loop.
SMALL_REPORT_BYTES = 16 << 10
# Attributes each device reported on its last Sync through this replica: Download checks
# assignments against them, not against the database copy (written behind, so late).
RECENT_DEVICES = 200_000
# What one thread hop of a DownloadChunks call reads (and what it holds, with the next
# hop's read ahead): many small chunks in one hop, a big one in pieces.
PIECES_BYTES = 1 << 20


def _installed(msgs) -> tuple[ModelState, ...]:
    """Validate a device's installed report: it is stored, so it must fit the schema."""
    if len(msgs) > MAX_INSTALLED:
        raise errors.InvalidArgument(f"at most {MAX_INSTALLED} installed models")
    for m in msgs:
        validate_name(m.model)
        if not 1 <= m.version <= MAX_VERSION:
            raise errors.InvalidArgument(f"installed {m.model}: version {m.version} out of range")
        if not VARIANT_NAME.fullmatch(m.variant):
            raise errors.InvalidArgument(f"installed {m.model}: invalid variant {m.variant!r:.40}")
    return states(msgs)


def _authorization(context) -> str | None:
    for key, value in context.invocation_metadata() or ():
        if key == "authorization":
            return value
    return None


def _assignment_pb(a: Assignment) -> device_pb2.ModelAssignment:
    v = a.variant
    return device_pb2.ModelAssignment(
        model=a.model,
        version=a.desired.version,
        variant=a.desired.variant,
        rollout=a.desired.rollout,
        artifact=device_pb2.ArtifactDescriptor(
            ciphertext_sha256=v.ciphertext_sha256,
            ciphertext_size=v.ciphertext_size,
            segment_size=v.segment_size,
            plaintext_sha256=v.plaintext_sha256,
            plaintext_size=v.plaintext_size,
            associated_data=associated_data(a.version.uid, v.name).decode(),
            url=a.url,
            url_expires_at=timestamp(a.url_expires_at),
        ),
        wrapped_data_key=a.wrapped_data_key,
        manifest=a.version.manifest,
        manifest_signature=a.version.manifest_signature,
        golden=_golden_pb(a.version.golden),
    )


def _golden_pb(golden: dict) -> device_pb2.ArtifactDescriptor | None:
    """Describe a version's golden data for download (None for versions without it)."""
    if not golden:
        return None
    return device_pb2.ArtifactDescriptor(
        ciphertext_sha256=golden["ciphertext_sha256"],
        ciphertext_size=golden["ciphertext_size"],
        segment_size=golden["segment_size"],
        plaintext_sha256=golden["plaintext_sha256"],
        plaintext_size=golden["plaintext_size"],
        associated_data=golden["associated_data"],
    )


class _ChunkPieces:
    """The pieces of several chunks, in the order asked, read in threads.

    Each `next()` reads up to PIECES_BYTES (one thread hop for many small chunks). A
    chunk must be the size its signed table gives it: one that ends short of it or runs
    past it is an integrity failure (DATA_LOSS), as the blob store no longer holds it
    as it was pushed.
    """

    def __init__(self, read, artifacts: list[str], sizes: list[int]) -> None:
        self._read, self._lock = read, threading.Lock()
        self._queue = collections.deque(zip(artifacts, sizes, strict=True))
        self._current = None  # [artifact, size, pieces, offset] of the chunk being read
        self._failed: Exception | None = None

    def next(self) -> list[tuple[str, int, bytes]]:
        """Return the next (artifact, offset, data) pieces, [] at the end (blocking).

        A read that fails after others succeeded returns those first: the failure is
        raised by the next call, so a device gets every chunk before the one that failed.
        """
        found: list[tuple[str, int, bytes]] = []
        with self._lock:
            if self._failed is not None:
                raise self._failed
            try:
                self._read_into(found)
            except Exception as exc:
                if not found:
                    raise
                self._failed = exc
        return found

    def _read_into(self, found: list) -> None:
        taken = 0
        while taken < PIECES_BYTES:
            if self._current is None:
                if not self._queue:
                    return
                artifact, size = self._queue[0]
                if taken and taken + min(size, CHUNK_SIZE) > PIECES_BYTES:
                    return  # its first piece is the next hop's
                self._queue.popleft()
                self._current = [artifact, size, self._read(artifact), 0]
            artifact, size, pieces, offset = self._current
            if taken and taken + min(size - offset, CHUNK_SIZE) > PIECES_BYTES:
                return  # a piece of up to CHUNK_SIZE would take the hop past PIECES_BYTES
            piece = next(pieces, None)
            if piece is None:
                self._close_current()
                if offset < size:
                    raise errors.IntegrityError(
                        f"chunk {artifact[:12]} ended at {offset} of {size} bytes"
                    )
                continue
            if len(piece) > size - offset:  # a blob longer than its table says
                self._close_current()
                raise errors.IntegrityError(f"chunk {artifact[:12]} is longer than {size} bytes")
            found.append((artifact, offset, piece))
            self._current[3] = offset + len(piece)
            taken += len(piece)

    def _close_current(self) -> None:
        close = getattr(self._current[2], "close", None)
        self._current = None
        if close is not None:
            close()

    def close(self) -> None:
        """Close the chunk being read (blocking until a read in progress returns)."""
        with self._lock:
            self._queue.clear()  # a read that comes after (the read-ahead's) opens nothing
            if self._current is not None:
                self._close_current()


class DeviceServicer(device_pb2_grpc.DeviceServiceServicer):
    """The device API."""

    def __init__(
        self,
        *,
        fleet: Fleet,
        store: FleetStore,
        delivery: Delivery,
        watchers: Watchers,
        writer: DeviceWriter,
        signing_keys: SigningKeys,
        poll_interval_s: int,
        telemetry: Telemetry,
        recommendations: Recommendations | None = None,
        enroll_throttle: Throttle | None = None,
    ) -> None:
        self._enroll_throttle = enroll_throttle or new_enroll_throttle()
        self._fleet, self._store, self._delivery = fleet, store, delivery
        self._telemetry, self._recommendations = telemetry, recommendations
        self._watchers, self._writer = watchers, writer
        self._signing_keys, self._poll = signing_keys, poll_interval_s
        # The chain's messages, converted once per re-read of the chain (not per Sync).
        self._chain_pb: tuple[tuple, list] = ((), [])
        self._recent: collections.OrderedDict[str, dict] = collections.OrderedDict()
        self._recent_lock = threading.Lock()
        # Streams opened together (every device after a restart) read their devices together.
        self._watch_states = Coalesced(lambda ids: self._store.watch_states(ids))

    @mapped
    def Enroll(self, request, context):  # noqa: D102, N802
        # Bad enrollment tokens are guesses: throttled per client address and overall
        # (RESOURCE_EXHAUSTED, saying when to retry); good ones are never held back.
        with self._enroll_throttle.attempt(peer_key(context.peer())):
            device, credential = self._fleet.enroll(
                token=request.enrollment_token,
                attributes=attributes_dict(request.attributes),
                public_keyset=request.public_keyset,
            )
        return device_pb2.EnrollResponse(
            device_id=device.id,
            credential=credential,
            signing_public_keys=self._signing_keys.valid_public_keys(),
            poll_interval_s=self._poll,
            signing_keys=self._chain(),
        )

    def _chain(self, chain: tuple = ()):
        """Return the chain's messages (`chain`, or the chain now), converted once."""
        chain = chain or self._signing_keys.chain()
        cached, messages = self._chain_pb
        if cached is not chain:
            messages = chain_pb(chain)
            self._chain_pb = (chain, messages)
        return messages

    def _remember(self, device_id: str, attrs: dict) -> None:
        with self._recent_lock:
            self._recent[device_id] = attrs
            self._recent.move_to_end(device_id)
            if len(self._recent) > RECENT_DEVICES:
                self._recent.popitem(last=False)

    def _with_recommendation(
        self, msg: device_pb2.ModelAssignment, attrs: dict, cached_only: bool = False
    ) -> device_pb2.ModelAssignment:
        if self._recommendations is not None:
            best = self._recommendations.for_device(
                msg.model, msg.version, msg.variant, attrs, cached_only=cached_only
            )
            if best is not None:
                msg.recommended_config, msg.recommended_samples = best
        return msg

    def _sync_blocking(self, authorization: str | None, request) -> device_pb2.SyncResponse:
        # Blocking (database, KEK, HPKE, signing): runs in a worker thread, never on the
        # event loop that carries every Watch stream.
        return self._sync(self._fleet.authenticate(authorization), request, on_loop=False)

    def _sync(self, device: DeviceAuth, request, *, on_loop: bool) -> device_pb2.SyncResponse:
        """Answer a Sync; `on_loop`: from memory alone, or NotCached (ask in a thread)."""
        installed = _installed(request.installed)
        attrs = self._fleet.device_attributes(device, attributes_dict(request.attributes))
        result: SyncResult = self._delivery.sync(
            device, attrs, installed, request.nonce, cached_only=on_loop
        )
        models = [
            self._with_recommendation(_assignment_pb(a), attrs, on_loop) for a in result.assignments
        ]
        desired = {a.model: a.desired for a in result.assignments}
        self._remember(device.id, attrs)
        now = dt.datetime.now(dt.UTC)
        # Not `synced`: that waits for the device's Ack of this answer.
        self._writer.add(DeviceUpdate(device.id, now, attrs, installed))
        if on_loop:
            self._watchers.note_sync(device.id, attrs, desired)
        else:
            self._watchers.note_sync_threadsafe(device.id, attrs, desired)
        return device_pb2.SyncResponse(
            revision=result.revision,
            models=models,
            document=result.document,
            document_signature=result.signature,
            signing_key_id=result.key_id,
            poll_interval_s=self._poll,
            signing_keys=self._chain(result.chain),
        )

    @mapped_async
    async def Sync(self, request, context):  # noqa: D102, N802
        authorization = _authorization(context)
        # On the loop when everything the answer needs is in memory (the credential, the
        # versions and their data keys, a local signing key) and it is small: a thread
        # hop costs more than such an answer. Anything else waits in a thread.
        if request.ByteSize() <= SMALL_REPORT_BYTES:
            device = self._fleet.authenticate(authorization, cached_only=True)
            if device is not None:
                try:
                    return self._sync(device, request, on_loop=True)
                except (NotCached, Stale):
                    pass
        return await asyncio.to_thread(self._sync_blocking, authorization, request)

    def _ack(self, authorization: str | None, request) -> device_pb2.AckResponse:
        device = self._fleet.authenticate(authorization)
        self._accepted(device.id, request)
        return device_pb2.AckResponse()

    def _accepted(self, device_id: str, request, *, cached_only: bool = False) -> None:
        """Count the device synced to the answer it acknowledges (NotCached: see Ack)."""

        def record(synced: tuple[ModelState, ...]) -> None:
            self._writer.add(DeviceUpdate(device_id, dt.datetime.now(dt.UTC), synced=synced))

        self._delivery.accepted(
            device_id,
            request.document,
            request.document_signature,
            cached_only=cached_only,
            record=record,
        )

    @mapped_async
    async def Ack(self, request, context):  # noqa: D102, N802
        # The answer this replica just signed for the device, from a cached credential: a
        # digest and a dict update, on the loop. Anything else (a signature to check, a
        # credential to read) in a thread.
        authorization = _authorization(context)
        device = self._fleet.authenticate(authorization, cached_only=True)
        if device is not None:
            try:
                self._accepted(device.id, request, cached_only=True)
            except NotCached:
                pass
            else:
                return device_pb2.AckResponse()
        return await asyncio.to_thread(self._ack, authorization, request)

    async def _watch_state(self, device_id: str):
        state = await self._watch_states.get(device_id)
        if state is None:
            raise errors.NotFound(f"device {device_id!r} not found")
        if state.revoked:
            raise errors.PermissionDenied(f"device {device_id} is revoked")
        return state.attributes, fingerprint({s.model: s for s in state.synced})

    @mapped_async_stream
    async def Watch(self, request, context):  # noqa: D102, N802
        authorization = _authorization(context)
        # A cached credential is checked on the loop (a digest and a dict lookup), as Sync
        # and Ack do; only a lookup in the database takes a thread.
        device = self._fleet.authenticate(authorization, cached_only=True)
        if device is None:
            device = await asyncio.to_thread(self._fleet.authenticate, authorization)
        # The stream is registered before the device is read back from the database, so
        # a revocation is either seen in that read or closes the registered stream.
        load = lambda: self._watch_state(device.id)  # noqa: E731
        async for revision in self._watchers.stream(device.id, request.revision, load):
            yield device_pb2.WatchEvent(revision=revision)

    def _device_attributes(self, authorization: str | None) -> tuple[str, dict]:
        """Return (device id, the attributes its assignment is checked against)."""
        device = self._fleet.authenticate(authorization)
        with self._recent_lock:
            attrs = self._recent.get(device.id)
        if attrs is None:
            attrs = self._store.device_attributes([device.id]).get(device.id)
        if attrs is None:
            raise errors.PermissionDenied(f"device {device.id} is revoked")
        return device.id, attrs

    def _open(self, authorization: str | None, request):
        """Return (the artifact's size, its first piece or None, an iterator over the rest)."""
        device_id, attrs = self._device_attributes(authorization)
        size, chunks = self._delivery.open_artifact(
            device_id, attrs, request.artifact, request.offset
        )
        return size, next(chunks, None), chunks

    def _open_chunks(self, authorization: str | None, request):
        """Return (the chunks' first pieces, a reader of the rest), all checked as assigned."""
        device_id, attrs = self._device_attributes(authorization)  # before anything else
        artifacts = list(request.artifacts)
        if not 1 <= len(artifacts) <= MAX_CHUNKS_PER_CALL:
            raise errors.InvalidArgument(
                f"ask for 1 to {MAX_CHUNKS_PER_CALL} chunks a call, not {len(artifacts)}"
            )
        if len(set(artifacts)) != len(artifacts):
            raise errors.InvalidArgument("a chunk is asked for more than once")
        sizes = self._delivery.assigned_sizes(device_id, attrs, artifacts)
        pieces = _ChunkPieces(self._delivery.read, artifacts, sizes)
        try:
            return pieces.next(), pieces
        except BaseException:
            pieces.close()
            raise

    @mapped_async_stream
    async def Download(self, request, context):  # noqa: D102, N802
        authorization = _authorization(context)
        # The first piece is read with the checks, in one thread hop: a chunk of a chunked
        # model is often one piece, so a Download costs one hop, not three.
        size, chunk, chunks = await asyncio.to_thread(self._open, authorization, request)
        reader, offset = Reader(chunks), request.offset
        # The next piece is read in a thread while this one is sent; none after the last.
        read = reader.next if chunk is not None and offset + len(chunk) < size else None
        async with contextlib.aclosing(read_ahead(chunk, read, reader.close)) as pieces:
            async for piece in pieces:
                # Exact: a revocation stops a download in progress. On the loop when the
                # credential is cached (a dict lookup), in a thread when it must be read.
                if self._fleet.authenticate(authorization, cached_only=True) is None:
                    await asyncio.to_thread(self._fleet.authenticate, authorization)
                yield device_pb2.DownloadChunk(offset=offset, data=piece)
                offset += len(piece)
                if offset >= size:  # no hop just to hear that the end is the end
                    break

    @mapped_async_stream
    async def DownloadChunks(self, request, context):  # noqa: D102, N802
        authorization = _authorization(context)
        # The checks and the first read in one thread hop; then each hop reads the next
        # pieces while the ones before it are sent.
        batch, pieces = await asyncio.to_thread(self._open_chunks, authorization, request)

        def read() -> list | None:  # a hop that found no pieces is the end
            return pieces.next() or None

        async with contextlib.aclosing(read_ahead(batch or None, read, pieces.close)) as batches:
            async for batch in batches:
                # Exact: a revocation stops a download in progress (as in Download).
                if self._fleet.authenticate(authorization, cached_only=True) is None:
                    await asyncio.to_thread(self._fleet.authenticate, authorization)
                for artifact, offset, data in batch:
                    yield device_pb2.DownloadChunk(artifact=artifact, offset=offset, data=data)

    def _checked(self, authorization: str | None, request):
        device = self._fleet.authenticate(authorization)
        return self._convert(device.id, request)

    def _convert(self, device_id: str, request) -> ReportBatch:
        try:
            return report_batch(device_id, request, dt.datetime.now(dt.UTC))
        except errors.InvalidArgument as exc:
            # Counted on the device (`fleet show`): its telemetry is not reaching rollups.
            self._telemetry.refused(device_id, str(exc))
            raise

    @mapped_async
    async def Report(self, request, context):  # noqa: D102, N802
        # Checked on the loop when the credential is cached (a thread hop costs more than
        # the check), in a thread when it is not; then stored by the group-commit writer,
        # which holds no thread while this call waits.
        authorization = _authorization(context)
        device = None
        if request.ByteSize() <= SMALL_REPORT_BYTES:  # a big one would stall the loop
            device = self._fleet.authenticate(authorization, cached_only=True)
        if device is None:
            batch = await asyncio.to_thread(self._checked, authorization, request)
        else:
            batch = self._convert(device.id, request)
        fresh = await self._telemetry.report_async(batch)
        return device_pb2.ReportResponse(duplicate=not fresh)
