"""A blocking test double of a device: real key pair, real gRPC calls, one channel per call."""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
from dataclasses import dataclass, field

from contract.assignment import new_nonce, verify_sync
from contract.device_client import DeviceConnection, open_channel
from contract.envelope import decrypt_stream
from contract.key_wrap import DeviceKeyPair
from contract.pinned_keys import PinnedKeyRing
from control_plane.api.fleet_convert import attributes_pb
from protos import device_pb2
from tests.control_plane.helpers import tls_of


def run(address: str, credential: str, fn):
    """Run `fn(conn)` (a coroutine function) on a fresh channel."""

    async def main():
        channel = open_channel(address, tls_of(address))
        try:
            return await fn(DeviceConnection(channel, credential))
        finally:
            await channel.close()

    return asyncio.run(main())


@dataclass
class Device:
    """An enrolled device with its secrets, driving the real DeviceService."""

    address: str
    id: str
    credential: str
    keys: DeviceKeyPair
    signing_keys: list[bytes]
    attributes: dict
    ring: PinnedKeyRing
    revision: int = 0
    installed: list = field(default_factory=list)

    @classmethod
    def enroll(cls, address: str, token: str, attributes: dict | None = None) -> Device:
        keys = DeviceKeyPair.generate()
        attributes = attributes or {}
        response = run(
            address,
            "",
            lambda c: c.enroll(token, attributes_pb(attributes), keys.public_keyset()),
        )
        return cls(
            address,
            response.device_id,
            response.credential,
            keys,
            list(response.signing_public_keys),
            attributes,
            PinnedKeyRing.from_enrollment(response, dt.datetime.now(dt.UTC)),
        )

    def sync_raw(
        self, revision: int | None = None, *, nonce: bytes = b"\0" * 16
    ) -> device_pb2.SyncResponse:
        installed = [device_pb2.InstalledModel(**m) for m in self.installed]
        rev = self.revision if revision is None else revision
        return run(
            self.address,
            self.credential,
            lambda c: c.sync(attributes_pb(self.attributes), installed, rev, nonce=nonce),
        )

    def ack(self, response: device_pb2.SyncResponse) -> device_pb2.AckResponse:
        """Say this device accepted `response` (the server then counts it synced)."""
        return run(
            self.address,
            self.credential,
            lambda c: c.ack(response.document, response.document_signature),
        )

    def sync(self, now: dt.datetime | None = None, tamper=None):
        """Sync with a fresh nonce, verify and acknowledge the answer, remember its revision.

        The pinned keys learn the answer's chain first, as a device does; `tamper` may
        edit the response before the device sees it (an attacker on the path).
        """
        now = now or dt.datetime.now(dt.UTC)
        nonce = new_nonce()
        response = self.sync_raw(nonce=nonce)
        if tamper is not None:
            tamper(response)
        self.ring = self.ring.update(response.signing_keys, now)
        verified = verify_sync(
            response,
            device_id=self.id,
            nonce=nonce,
            keys=self.ring.valid_keys(now),
            last_revision=self.revision,
            now=now,
        )
        self.revision = verified.revision
        self.ack(response)
        return verified

    def report(self, request: device_pb2.ReportRequest) -> device_pb2.ReportResponse:
        """Send one Report batch as it is (no checks on this side)."""
        return run(self.address, self.credential, lambda c: c.report(request))

    def download(self, artifact: str, size: int, offset: int = 0) -> bytes:
        async def fetch(c):
            return b"".join([d async for _, d in c.download(artifact, size=size, offset=offset)])

        return run(self.address, self.credential, fetch)

    def install(self, verified, model: str) -> bytes:
        """Download, unwrap, decrypt and check one assigned model; returns the plaintext."""
        m = verified.models[model]
        ciphertext = self.download(m.ciphertext_sha256, m.ciphertext_size)
        key = self.keys.unwrap(m.wrapped_data_key, device_id=self.id, version_uid=m.uid)
        plaintext = b"".join(decrypt_stream(key, [ciphertext], associated_data=m.associated_data))
        assert hashlib.sha256(plaintext).hexdigest() == m.plaintext_sha256
        self.installed = [i for i in self.installed if i["model"] != model]
        self.installed.append({"model": model, "version": m.version, "variant": m.variant})
        return plaintext

    def next_watch_event(self, timeout: float, revision: int | None = None) -> int | None:
        """Open Watch and return the first revision pushed within `timeout`, else None."""

        async def first(c):
            async def get():
                async for rev in c.watch(self.revision if revision is None else revision):
                    return rev
                return None

            try:
                return await asyncio.wait_for(get(), timeout)
            except TimeoutError:
                return None

        return run(self.address, self.credential, first)


class Watching:
    """A Watch stream held open in a background thread, collecting what it receives."""

    def __init__(self, device: Device, revision: int | None = None) -> None:
        import threading

        self.events: list[int] = []
        self.error: Exception | None = None
        self.opened = threading.Event()
        self._got = threading.Condition()
        self._device = device
        self._revision = device.revision if revision is None else revision
        self._loop = asyncio.new_event_loop()
        self._task = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Watching:
        self._thread.start()
        self.opened.wait(5)
        return self

    def __exit__(self, *exc) -> None:
        if self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
        self._thread.join(5)

    def _run(self) -> None:
        async def main():
            channel = open_channel(self._device.address, tls_of(self._device.address))
            try:
                conn = DeviceConnection(channel, self._device.credential)
                stream = conn.watch(self._revision)
                self.opened.set()
                async for rev in stream:
                    with self._got:
                        self.events.append(rev)
                        self._got.notify_all()
            except Exception as exc:  # noqa: BLE001 - the test inspects it
                self.error = exc
            finally:
                with self._got:
                    self._got.notify_all()
                await channel.close()

        self._task = self._loop.create_task(main())
        try:
            self._loop.run_until_complete(self._task)
        except asyncio.CancelledError:
            pass

    def wait(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Wait until `count` events arrived (or the stream ended); True if they did."""
        with self._got:
            self._got.wait_for(
                lambda: (
                    len(self.events) >= count
                    or self.error is not None
                    or not self._thread.is_alive()
                ),
                timeout,
            )
            return len(self.events) >= count
