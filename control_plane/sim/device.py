"""One simulated device: the same calls and checks as a real agent, minus running models.

It syncs, verifies the signed assignment against the keys it pinned at enrollment (and
their successors, each accepted only through an endorsement by a key already pinned),
acknowledges the answer it accepted (so the server counts it synced), measures the
control plane's time from it as the agent does (contract.server_clock), unwraps each new
version's data key with its own key pair, has the artifact checked (downloaded and
decrypted once per process, see `artifacts`), counts it installed and Syncs again so the
server records what it runs. It holds a Watch stream and Syncs (after a little jitter)
when the server pushes a revision; when the stream dies it reconnects with full-jitter
backoff and, while it cannot, Syncs on the server's poll interval.

Its reports go through a queue (`outbox.ReportQueue`) as an agent's do: one batch per
period, periods back to back on the control plane's time, sent oldest first, kept through
an outage and delivered in order once the control plane is back.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import random
import time
from collections.abc import Callable

import grpc

from contract import errors
from contract.assignment import (
    AssignmentRejected,
    VerifiedAssignment,
    VerifiedModel,
    new_nonce,
    verify_sync,
)
from contract.device_client import DeviceCallError, DeviceConnection, backoff_s
from contract.key_wrap import DeviceKeyPair, KeyUnwrapError
from contract.pinned_keys import PinnedKeyRing
from contract.server_clock import ServerClock
from control_plane.api.fleet_convert import attributes_pb
from control_plane.sim.artifacts import ArtifactCache
from control_plane.sim.outbox import ReportQueue
from control_plane.sim.state import Identity
from protos import device_pb2

# Each install is reported by one more Sync; a server that keeps changing its answer
# gets a few rounds, then the device waits for the next push.
MAX_ROUNDS = 3
# A Sync that fails after the connection's own retries is tried again this often.
SYNC_ATTEMPTS = 3
# A stream that stayed up this long was healthy: the next failure starts backoff afresh.
STABLE_S = 5.0
AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# A batch refused with this will never be taken: dropped and counted, not retried.
REFUSED = grpc.StatusCode.INVALID_ARGUMENT

Target = tuple[str, int, str]  # (model, version, variant)


class SimDevice:
    """A device's identity, its view of its assignment, and its counters."""

    def __init__(
        self,
        identity: Identity,
        channel: grpc.aio.Channel,
        *,
        cache: ArtifactCache,
        notify: Callable[[SimDevice], None] = lambda device: None,
        outbox: ReportQueue | None = None,
    ) -> None:
        self.identity, self.id = identity, identity.device_id
        self._conn = DeviceConnection(channel, identity.credential)
        self._keys = DeviceKeyPair.from_private(identity.private_keyset)
        self._pinned = PinnedKeyRing.from_pems(identity.signing_public_keys)
        self._attrs = attributes_pb(identity.attributes)
        self._cache, self._notify = cache, notify
        self._lock = asyncio.Lock()
        self.poll_interval_s = identity.poll_interval_s
        self.revision = 0
        self.desired: dict[str, VerifiedModel] = {}
        self.installed: dict[str, tuple[int, str]] = {}
        # The installed models that are language models (their manifests say so).
        self.llm_models: set[str] = set()
        # When this device first received / installed each target (time.monotonic()).
        self.synced_at: dict[Target, float] = {}
        self.installed_at: dict[Target, float] = {}
        self.syncs = 0
        self.failures: collections.Counter[str] = collections.Counter()
        self.watching = False
        self.reconnects = 0
        # Where a device that lags stands (for a timeout's message): the last revision its
        # Watch stream brought and when (time.monotonic()), and since when a Sync has been
        # under way (None: none is).
        self.pushed: tuple[int, float] | None = None
        self.syncing_since: float | None = None
        self.rejected = ""  # why the server refuses this device for good
        self.stop_reports = False  # stop_reporting() asks the report loop to end
        self._last_sync = 0.0
        self.reports = 0  # batches the control plane took
        self.clock = ServerClock()  # the control plane's time, measured at every Sync
        self.outbox = outbox or ReportQueue()
        self._period_start: float | None = None  # control plane time the next period starts
        self._flushing = asyncio.Lock()

    # -- sync and install -----------------------------------------------------------------

    async def sync(self) -> bool:
        """Sync, install what is newly assigned and report it; False if it failed."""
        async with self._lock:  # a push and a poll must not interleave their rounds
            self.syncing_since = time.monotonic()
            try:
                for _ in range(MAX_ROUNDS):
                    if not await self._install(await self._sync_once()):
                        break
                return True
            except DeviceCallError as exc:
                self.failures[exc.code.name.lower()] += 1
                if exc.code in AUTH_CODES:
                    self.rejected = exc.message
            except AssignmentRejected:
                self.failures["assignment_rejected"] += 1
            except (errors.IntegrityError, KeyUnwrapError):
                self.failures["integrity"] += 1
            except (ValueError, KeyError, TypeError):
                # A signed document that verifies but does not parse: the agent drops the
                # answer and carries on, and so does the simulated device.
                self.failures["malformed"] += 1
            finally:
                self.syncing_since = None
            return False

    async def sync_retrying(self) -> bool:
        """Sync, trying again after a failure that another attempt can fix."""
        for attempt in range(SYNC_ATTEMPTS):
            if await self.sync() or self.rejected:
                return not self.rejected
            await asyncio.sleep(backoff_s(attempt))
        return False

    async def _sync_once(self) -> VerifiedAssignment:
        installed = [
            device_pb2.InstalledModel(model=m, version=v, variant=variant)
            for m, (v, variant) in sorted(self.installed.items())
        ]
        nonce = new_nonce()
        sent = self.clock.monotonic()
        response = await self._conn.sync(self._attrs, installed, self.revision, nonce=nonce)
        at = received = self.clock.monotonic()
        now = self.clock.now_datetime()
        # Learn a rotated key only through its endorsement; forget keys past their end.
        self._pinned = self._pinned.update(response.signing_keys, now)
        assignment = verify_sync(
            response,
            device_id=self.id,
            nonce=nonce,
            keys=self._pinned.valid_keys(now),
            last_revision=self.revision,
            round_trip_s=received - sent,
        )
        if assignment.issued_at is not None:
            self.clock.measure(assignment.issued_at.timestamp(), sent, received)
        await self._ack(response)
        self.revision, self.desired = assignment.revision, assignment.models
        self.poll_interval_s = response.poll_interval_s or self.poll_interval_s
        self.syncs += 1
        self._last_sync = at
        for m in assignment.models.values():
            self.synced_at.setdefault((m.model, m.version, m.variant), at)
        self._notify(self)
        return assignment

    async def _ack(self, response: device_pb2.SyncResponse) -> None:
        """Acknowledge an accepted answer; a failure is counted and the device goes on."""
        try:
            await self._conn.ack(response.document, response.document_signature)
        except DeviceCallError as exc:
            if exc.code in AUTH_CODES:
                raise
            self.failures[f"ack_{exc.code.name.lower()}"] += 1

    async def _install(self, assignment: VerifiedAssignment) -> bool:
        """Install every assigned version not yet installed; return whether any changed."""
        changed = False
        for name in [m for m in self.installed if m not in assignment.models]:
            del self.installed[name]  # no longer assigned: the agent removes it
            self.llm_models.discard(name)
            changed = True
        for m in assignment.models.values():
            if self.installed.get(m.model) == (m.version, m.variant):
                continue
            if not m.wrapped_data_key:
                raise AssignmentRejected(f"{m.model}: no data key for a version not installed")
            key = self._keys.unwrap(m.wrapped_data_key, device_id=self.id, version_uid=m.uid)
            await self._cache.check(self._conn, m, key)
            self.installed[m.model] = (m.version, m.variant)
            if m.llm is not None:
                self.llm_models.add(m.model)
            else:
                self.llm_models.discard(m.model)
            self.installed_at.setdefault((m.model, m.version, m.variant), time.monotonic())
            changed = True
        if changed:
            self._notify(self)
        return changed

    # -- watch ------------------------------------------------------------------------------

    async def watch_forever(self, jitter_s: float) -> None:
        """Hold the Watch stream until cancelled or refused; Sync on every push."""
        attempt = 0
        while not self.rejected:
            started = time.monotonic()
            try:
                self.watching = True
                async for revision in self._conn.watch(self.revision):
                    attempt = 0
                    self.pushed = (revision, time.monotonic())
                    if revision > self.revision:  # else a Sync already brought it
                        await asyncio.sleep(random.uniform(0, jitter_s))
                        await self.sync_retrying()
            except DeviceCallError as exc:
                if exc.code in AUTH_CODES:
                    self.rejected = exc.message
                    break
            finally:
                self.watching = False
            if time.monotonic() - started > STABLE_S:
                attempt = 0
            self.reconnects += 1
            await asyncio.sleep(backoff_s(attempt))
            attempt += 1
            if time.monotonic() - self._last_sync >= self.poll_interval_s:
                await self.sync()  # the stream is down: poll, as the server asked

    # -- telemetry --------------------------------------------------------------------------

    async def report_forever(self, load, interval_s: float, injections) -> None:
        """Report what its models did every `interval_s` (first after a random phase)."""
        await asyncio.sleep(random.uniform(0, interval_s))
        self.start_reporting()
        while not self.rejected and not self.stop_reports:
            await asyncio.sleep(interval_s)
            if self.stop_reports:
                break
            self.cut_report(load, injections)
            await self.flush_reports()

    def start_reporting(self) -> None:
        """Begin the first period now (control plane time), unless one is under way."""
        if self._period_start is None:
            self._period_start = self.clock.now()

    def cut_report(self, load, injections) -> device_pb2.ReportRequest | None:
        """Queue the batch of the period since the last cut; None if it had nothing.

        Periods are back to back on the control plane's time (one that had nothing to
        report leaves a gap, never an overlap).
        """
        self.start_reporting()
        start = self._period_start
        end = self._period_start = max(self.clock.now(), start)
        batch = load.batch(
            self.installed,
            dt.datetime.fromtimestamp(start, dt.UTC),
            dt.datetime.fromtimestamp(end, dt.UTC),
            injections,
            self.llm_models,
        )
        if batch is None:
            return None
        if self.clock.reading is not None:
            batch.clock_offset_s = self.clock.offset_s
        self.outbox.put(batch)
        self._notify(self)
        return batch

    async def flush_reports(self) -> int:
        """Send queued batches oldest first until one is not taken; return how many were.

        A batch refused as invalid is dropped (counted); any other failure (the control
        plane or its database away, a lost reply) leaves it first in the queue, to go
        again, unchanged, at the next flush: the server applies a batch id once.
        """
        sent = 0
        async with self._flushing:
            while (batch := self.outbox.head()) is not None and not self.rejected:
                try:
                    await self._conn.report(batch)
                except DeviceCallError as exc:
                    self.failures[f"report_{exc.code.name.lower()}"] += 1
                    if exc.code == REFUSED:
                        self.outbox.refuse(batch)
                        continue
                    if exc.code in AUTH_CODES:
                        self.rejected = exc.message
                    break
                self.outbox.ack(batch)
                self.reports += 1
                sent += 1
        if sent:
            self._notify(self)
        return sent

    # -- views ------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """Return the device as `skiff sim --json` prints it (desired as `fleet ls` does).

        Attributes are those the device reports; a token may stamp more on the server.
        """
        body = {
            "id": self.id,
            "attributes": self.identity.attributes,
            "desired": {
                m.model: {"version": m.version, "variant": m.variant, "rollout": m.rollout}
                for m in sorted(self.desired.values(), key=lambda m: m.model)
            },
            "installed": {
                m: {"version": v, "variant": variant}
                for m, (v, variant) in sorted(self.installed.items())
            },
            "syncs": self.syncs,
            "revision": self.revision,
        }
        if self.rejected:
            body["rejected"] = self.rejected
        return body
