"""The device agent: enroll once, then keep the installed models at the desired state.

`Agent.sync_once()` asks the control plane for the desired state, checks the signed
answer against the pinned keys (device, nonce, revision, expiry, digests), installs
what changed (device_agent.install) and says whether the device now runs its desired
state. `Agent.run()` does that on start, on every revision the Watch stream pushes and
whenever the poll interval runs out, reconnecting with exponential backoff and full
jitter, until `stop` is set.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import random
from dataclasses import dataclass, field

import grpc

from control_plane.api.fleet_convert import attributes_pb
from device_agent.assignment import AssignmentRejected, VerifiedModel, new_nonce, verify_sync
from device_agent.connection import DeviceCallError, DeviceConnection, backoff_s, open_channel
from device_agent.identity import DeviceKeyPair, KeyUnwrapError
from device_agent.install import Installer, InstallOutcome, IntegrityFailure
from device_agent.signing_keys import KeyRing
from device_agent.state import AgentError, Identity, StateDir
from device_agent.transport import ClientTls
from protos import device_pb2

log = logging.getLogger("skiff.agent")

AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# A Watch stream that stayed up this long was healthy: the next failure starts backoff over.
STABLE_S = 10.0
# After a failed sync the next try comes after 10 s, 20 s, ... up to the poll interval.
RETRY_BASE_S = 5.0


class Refused(AgentError):
    """The control plane refuses this device for good (revoked, or a bad token)."""


@dataclass
class SyncOutcome:
    """One Sync and what it installed; `converged` says the device runs its desired state."""

    revision: int
    desired: dict[str, tuple[int, str]]
    installs: list[InstallOutcome] = field(default_factory=list)

    @property
    def converged(self) -> bool:
        """Return whether every desired version is active now."""
        return all(o.result in ("activated", "active") for o in self.installs) and len(
            self.installs
        ) == len(self.desired)


class Agent:
    """One device's agent over a locked state directory."""

    def __init__(
        self,
        state: StateDir,
        server: str,
        *,
        tls: ClientTls | None = None,
        enroll_token: str = "",
        attributes: dict | None = None,
    ) -> None:
        self.state = state
        self.server = server
        self._tls = tls
        self._enroll_token = enroll_token
        self._attributes = attributes
        self._channel: grpc.aio.Channel | None = None
        self._conn: DeviceConnection | None = None
        self._keys: DeviceKeyPair | None = None
        self.identity: Identity | None = None
        self.installer: Installer | None = None
        self._sync_lock = asyncio.Lock()
        self.last: SyncOutcome | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Agent:
        self.state.lock()
        try:
            self._channel = open_channel(self.server, self._tls)
            self.identity = await self._identity()
            try:
                self._keys = DeviceKeyPair.from_private(self.identity.private_keyset)
            except Exception:  # noqa: BLE001 - Tink's own error types
                raise AgentError(
                    f"{self.state.identity_file}: the device key set is damaged"
                ) from None
        except BaseException:
            await self.close()
            raise
        self._conn = DeviceConnection(self._channel, self.identity.credential)
        self.installer = Installer(self.state, self._unwrap)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel and let go of the state directory."""
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self.state.unlock()

    async def _identity(self) -> Identity:
        """Load this device's identity, or enroll with the token to make one."""
        identity = self.state.load_identity()
        if identity is not None:
            changed = {}
            if self._attributes is not None and self._attributes != identity.attributes:
                changed["attributes"] = self._attributes
            if self.server != identity.server:
                changed["server"] = self.server
            if changed:
                identity = Identity(**{**identity.__dict__, **changed})
                self.state.save_identity(identity)
            return identity
        if not self._enroll_token:
            raise AgentError(
                f"{self.state.path} holds no device identity: pass --enroll-token to enroll"
            )
        keys = DeviceKeyPair.generate()  # the private half never leaves the state dir
        attributes = self._attributes or {}
        conn = DeviceConnection(self._channel)
        try:
            reply = await conn.enroll(
                self._enroll_token, attributes_pb(attributes), keys.public_keyset()
            )
        except DeviceCallError as exc:
            if exc.code in AUTH_CODES or exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise Refused(f"enrollment refused: {exc.message}") from None
            raise
        identity = Identity(
            server=self.server,
            device_id=reply.device_id,
            credential=reply.credential,
            private_keyset=keys.private_keyset(),
            pinned=KeyRing.from_enrollment(reply, dt.datetime.now(dt.UTC)),
            attributes=attributes,
        )
        self.state.save_identity(identity)
        log.info("enrolled as %s", identity.device_id)
        return identity

    def _unwrap(self, m: VerifiedModel) -> bytes:
        try:
            return self._keys.unwrap(
                m.wrapped_data_key, device_id=self.identity.device_id, version_uid=m.uid
            )
        except KeyUnwrapError as exc:
            raise IntegrityFailure(f"{m.model}: data key does not unwrap ({exc})") from None

    # -- sync --------------------------------------------------------------------------------

    async def sync_once(self) -> SyncOutcome:
        """Sync, install what changed; errors are recorded in sync.json and raised."""
        async with self._sync_lock:
            sync = self.state.load_sync()
            try:
                outcome = await self._sync(sync.revision)
            except DeviceCallError as exc:
                self._record(sync.failed(f"{exc.code.name.lower()}: {exc.message}"))
                if exc.code in AUTH_CODES:
                    raise Refused(f"the control plane refuses this device: {exc.message}") from None
                raise
            except (AssignmentRejected, AgentError) as exc:
                self._record(sync.failed(str(exc)))
                raise
            except OSError as exc:  # the state directory's disk: full, read-only, gone
                error = AgentError(f"state directory error: {exc.strerror or exc}")
                self._record(sync.failed(str(error)))
                raise error from None
            self.last = outcome
            return outcome

    def _record(self, sync) -> None:
        """Keep a failure for `agent status`, unless the disk refuses that too."""
        try:
            self.state.save_sync(sync)
        except OSError as exc:
            log.warning("cannot record the sync state: %s", exc.strerror or exc)

    async def _sync(self, last_revision: int) -> SyncOutcome:
        installed = [
            device_pb2.InstalledModel(model=name, version=v, variant=variant)
            for name, (v, variant) in sorted(self.installer.active().items())
        ]
        nonce = new_nonce()
        response = await self._conn.sync(
            attributes_pb(self.identity.attributes), installed, last_revision, nonce=nonce
        )
        now = dt.datetime.now(dt.UTC)
        pinned = self.identity.pinned.update(response.signing_keys, now)
        try:
            assignment = verify_sync(
                response,
                device_id=self.identity.device_id,
                nonce=nonce,
                keys=pinned.valid_keys(now),
                last_revision=last_revision,
                now=now,
            )
        except AssignmentRejected as exc:
            log.warning("assignment refused: %s", exc)
            raise
        if pinned != self.identity.pinned:  # learnt an endorsed rotation
            self.identity = Identity(**{**self.identity.__dict__, "pinned": pinned})
            self.state.save_identity(self.identity)
        desired = {name: (m.version, m.variant) for name, m in assignment.models.items()}
        outcome = SyncOutcome(assignment.revision, desired)
        for _, m in sorted(assignment.models.items()):
            outcome.installs.append(await self.installer.install(self._conn, m))
        for name in set(self.installer.pointers()) - set(assignment.models):
            self.installer.remove(name)
        assigned = set()
        for m in assignment.models.values():
            assigned.add(m.ciphertext_sha256)
            if m.golden is not None:
                assigned.add(m.golden.ciphertext_sha256)
        self.installer.collect_garbage(assigned)
        sync = self.state.load_sync()
        failures = [f"{o.model}: {o.reason}" for o in outcome.installs if o.result == "failed"]
        sync = sync.synced(assignment.revision, response.poll_interval_s)
        if failures:
            sync = sync.failed("; ".join(failures))
        self.state.save_sync(sync)
        return outcome

    # -- daemon ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Stay in sync until `stop` is set; Refused ends it (revoked device)."""
        tasks = [
            asyncio.create_task(self._watch_loop(), name="watch"),
            asyncio.create_task(self._poll_loop(), name="poll"),
        ]
        stopper = asyncio.create_task(stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper:
                    task.result()  # a loop ends only by raising Refused
        finally:
            for task in [stopper, *tasks]:
                task.cancel()
            await asyncio.gather(stopper, *tasks, return_exceptions=True)

    async def _try_sync(self) -> bool:
        """Sync; False (logged and recorded) if it failed or left the device behind."""
        try:
            outcome = await self.sync_once()
        except Refused:
            raise
        except (DeviceCallError, AssignmentRejected, AgentError) as exc:
            log.warning("sync failed: %s", exc)
            return False
        except Exception as exc:  # noqa: BLE001 - the daemon outlives a bug in one sync
            log.error("sync failed unexpectedly: %s: %s", type(exc).__name__, exc)
            self._record(self.state.load_sync().failed(f"{type(exc).__name__}: {exc}"))
            return False
        log.info(
            "synced revision %d: %s",
            outcome.revision,
            "running the desired state" if outcome.converged else "not converged",
        )
        return outcome.converged

    async def _poll_loop(self) -> None:
        failures = 0
        while True:
            failures = 0 if await self._try_sync() else failures + 1
            interval = self.state.load_sync().poll_interval_s
            if failures:  # try again sooner than the poll interval, backing off
                interval = min(interval, RETRY_BASE_S * 2 ** min(failures, 10))
            await asyncio.sleep(_jittered(interval))

    async def _watch_loop(self) -> None:
        attempt = 0
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                async for revision in self._conn.watch(self.state.load_sync().revision):
                    attempt = 0
                    if revision > self.state.load_sync().revision:
                        await self._try_sync()
            except DeviceCallError as exc:
                if exc.code in AUTH_CODES:
                    raise Refused(f"the control plane refuses this device: {exc.message}") from None
                log.info("watch stream ended: %s", exc.message)
            if loop.time() - started > STABLE_S:
                attempt = 0
            await asyncio.sleep(backoff_s(attempt))
            attempt += 1


def _jittered(interval_s: float) -> float:
    """Spread polls over ±10% so a fleet restarted together does not poll together."""
    return max(1.0, interval_s) * random.uniform(0.9, 1.1)
