"""The device's networking, in one place: calls to DeviceService over grpc.aio.

Retries only on UNAVAILABLE, with exponential backoff and full jitter; an auth error
(UNAUTHENTICATED, PERMISSION_DENIED) fails at once, since retrying cannot fix it. Every
unary call has a deadline. Downloads resume from the last byte received after a cut.
Many devices may share one channel (the simulator multiplexes thousands over a few):
the credential travels with each call, not with the channel.
"""

from __future__ import annotations

import asyncio
import collections
import random
from collections.abc import AsyncIterator, Sequence

import grpc

from contract.transport import ClientTls, channel_credentials, retry_helps, unreachable
from protos import device_pb2, device_pb2_grpc

UNARY_DEADLINE_S = 30.0
RETRIES = 5
BACKOFF_BASE_S = 0.25
BACKOFF_CAP_S = 30.0

CHANNEL_OPTIONS = [
    # Artifacts arrive in 1 MiB chunks; leave headroom for the envelope.
    ("grpc.max_receive_message_length", 8 << 20),
    # Ping an idle Watch stream every 30 s so NATs keep it mapped and a dead server is
    # noticed; the server allows pings this often (min_ping_interval 20 s).
    ("grpc.keepalive_time_ms", 30_000),
    # A server that misses a ping for 10 s is gone: end the stream and reconnect.
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class DeviceCallError(Exception):
    """A device call failed for good (after retries, or at once for auth errors)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


def backoff_s(attempt: int) -> float:
    """Return a full-jitter delay for retry number `attempt` (0-based)."""
    return random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt))


def open_channel(
    address: str, tls: ClientTls | None = None, options: list | None = None
) -> grpc.aio.Channel:
    """Open an asyncio channel to a control plane: TLS unless plaintext is safe (transport)."""
    options = CHANNEL_OPTIONS if options is None else options
    credentials = channel_credentials(address, tls)
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, credentials, options=options)


class DeviceConnection:
    """One device's calls over a (possibly shared) channel.

    `address` and `plaintext` (how the channel was opened) let a call that never reached
    the server say why in one line (`transport.unreachable`), as the CLI does.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        credential: str = "",
        *,
        address: str = "",
        plaintext: bool = False,
    ) -> None:
        self._stub = device_pb2_grpc.DeviceServiceStub(channel)
        self.credential = credential
        self._address, self._plaintext = address, plaintext
        # False once the control plane answered DownloadChunks UNIMPLEMENTED (older than
        # the call): chunks are then asked for one Download each.
        self._chunk_calls = True

    def _error(self, exc: grpc.aio.AioRpcError) -> DeviceCallError:
        details = exc.details() or exc.code().name.lower()
        if exc.code() == grpc.StatusCode.UNAVAILABLE and self._address:
            details = unreachable(self._address, details, plaintext=self._plaintext) or details
        return DeviceCallError(exc.code(), details)

    @staticmethod
    def _retry(exc: grpc.aio.AioRpcError) -> bool:
        return exc.code() == grpc.StatusCode.UNAVAILABLE and retry_helps(exc.details() or "")

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.credential}"),) if self.credential else ()

    async def _unary(self, method, request, retries: int = RETRIES):
        for attempt in range(retries + 1):
            try:
                return await method(request, timeout=UNARY_DEADLINE_S, metadata=self._metadata)
            except grpc.aio.AioRpcError as exc:
                if not self._retry(exc) or attempt == retries:
                    raise self._error(exc) from None
                await asyncio.sleep(backoff_s(attempt))
        raise AssertionError("unreachable")

    async def _after_cut(self, exc: grpc.aio.AioRpcError, attempt: int) -> int:
        """Wait before a stream cut by `exc` is asked again; return the next attempt.

        Raises DeviceCallError where it may not be retried, or has been too often.
        """
        if not self._retry(exc) or attempt == RETRIES:
            raise self._error(exc) from None
        await asyncio.sleep(backoff_s(attempt))
        return attempt + 1

    async def enroll(
        self, token: str, attributes: device_pb2.DeviceAttributes, public_keyset: bytes
    ) -> device_pb2.EnrollResponse:
        """Enroll; the caller keeps the credential (and the key pair) from now on."""
        request = device_pb2.EnrollRequest(
            enrollment_token=token, attributes=attributes, public_keyset=public_keyset
        )
        response = await self._unary(self._stub.Enroll, request)
        self.credential = response.credential
        return response

    async def sync(
        self,
        attributes: device_pb2.DeviceAttributes,
        installed: Sequence[device_pb2.InstalledModel],
        revision: int,
        *,
        nonce: bytes,
    ) -> device_pb2.SyncResponse:
        """Ask for the desired state; the signed answer echoes `nonce` (see verify_sync)."""
        request = device_pb2.SyncRequest(
            attributes=attributes, installed=list(installed), revision=revision, nonce=nonce
        )
        return await self._unary(self._stub.Sync, request)

    async def ack(self, document: bytes, signature: bytes) -> device_pb2.AckResponse:
        """Say this device accepted the Sync answer signed as `document`/`signature`."""
        request = device_pb2.AckRequest(document=document, document_signature=signature)
        return await self._unary(self._stub.Ack, request)

    async def report(self, batch: device_pb2.ReportRequest) -> device_pb2.ReportResponse:
        """Send one telemetry batch (sending it again is harmless: applied once)."""
        return await self._unary(self._stub.Report, batch, retries=1)

    async def watch(self, revision: int) -> AsyncIterator[int]:
        """Yield revisions the server pushes; ends (or raises) when the stream does."""
        call = self._stub.Watch(device_pb2.WatchRequest(revision=revision), metadata=self._metadata)
        try:
            async for event in call:
                yield event.revision
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None
        finally:
            call.cancel()

    async def download_chunks(
        self, artifacts: Sequence[tuple[str, int]]
    ) -> AsyncIterator[tuple[str, bytes]]:
        """Yield (id, ciphertext) of each chunk asked for, whole, in the order asked.

        `artifacts` holds (chunk id, ciphertext size) pairs, at most
        `contract.chunks.MAX_CHUNKS_PER_CALL`, each at most once. One DownloadChunks call
        brings them all; after a cut, the chunks not yet whole are asked for again. A
        control plane without the call is asked for each chunk with Download.
        """
        remaining = collections.deque(artifacts)
        attempt = 0
        while remaining:
            if not self._chunk_calls:
                for artifact, size in remaining:
                    yield artifact, await self._whole(artifact, size)
                return
            call = self._stub.DownloadChunks(
                device_pb2.DownloadChunksRequest(artifacts=[a for a, _ in remaining]),
                metadata=self._metadata,
            )
            pieces: list[bytes] = []
            got = 0
            try:
                async for message in call:
                    while remaining and remaining[0][1] == 0:  # nothing sent for an empty chunk
                        yield remaining.popleft()[0], b""
                    if not remaining:
                        raise DeviceCallError(
                            grpc.StatusCode.DATA_LOSS, "a piece past the last chunk"
                        )
                    artifact, size = remaining[0]
                    if message.artifact != artifact or message.offset != got:
                        raise DeviceCallError(grpc.StatusCode.DATA_LOSS, "chunk out of order")
                    got += len(message.data)
                    if got > size:
                        raise DeviceCallError(
                            grpc.StatusCode.DATA_LOSS, f"chunk {artifact[:12]} is over {size} bytes"
                        )
                    pieces.append(message.data)
                    if got == size:
                        remaining.popleft()
                        # Most chunks come in one piece: kept as it came, not copied.
                        yield artifact, pieces[0] if len(pieces) == 1 else b"".join(pieces)
                        pieces, got, attempt = [], 0, 0
                while remaining and remaining[0][1] == 0:
                    yield remaining.popleft()[0], b""
                if remaining:
                    raise DeviceCallError(grpc.StatusCode.DATA_LOSS, "download ended short")
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    # Also when a call in flight beside this one found it first.
                    self._chunk_calls = False
                    continue
                attempt = await self._after_cut(exc, attempt)
            finally:
                call.cancel()

    async def _whole(self, artifact: str, size: int) -> bytes:
        pieces = []
        async for _, piece in self.download(artifact, size=size):
            pieces.append(piece)
        return b"".join(pieces)

    async def download(
        self, artifact: str, *, size: int, offset: int = 0
    ) -> AsyncIterator[tuple[int, bytes]]:
        """Yield (offset, bytes) of an artifact from `offset`, resuming after a cut."""
        attempt = 0
        while offset < size:
            call = self._stub.Download(
                device_pb2.DownloadRequest(artifact=artifact, offset=offset),
                metadata=self._metadata,
            )
            try:
                async for chunk in call:
                    if chunk.offset != offset:
                        raise DeviceCallError(grpc.StatusCode.DATA_LOSS, "chunk out of order")
                    yield chunk.offset, chunk.data
                    offset += len(chunk.data)
                    attempt = 0
                if offset < size:
                    raise DeviceCallError(grpc.StatusCode.DATA_LOSS, "download ended short")
            except grpc.aio.AioRpcError as exc:
                attempt = await self._after_cut(exc, attempt)
            finally:
                call.cancel()
