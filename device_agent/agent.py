"""The device agent: enroll once, then keep the installed models at the desired state.

`Agent.sync_once()` asks the control plane for the desired state, checks the signed
answer against the pinned keys (device, nonce, revision, expiry, digests), installs
what changed (device_agent.install) and says whether the device now runs its desired
state. `Agent.run()` does that on start, on every revision the Watch stream pushes and
whenever the poll interval runs out, reconnecting with exponential backoff and full
jitter, until `stop` is set.

Time is the control plane's: each signed answer says when it was signed and echoes the
agent's nonce, so the agent measures its clock's offset from it (contract.server_clock),
judges expiry on the control plane's time, stamps its reports with it, and says in one
line (log, `agent status`, telemetry) when its own clock is far off. Each answer it
accepts is acknowledged (`Ack`): only then does the control plane count it as synced.

With `serve=True`, `run()` also serves the installed models to apps on the device
(device_agent.local_api), swaps each newly activated version in, goes back to the
previous version when the active one fails at run time, and reports telemetry
(device_agent.report_outbox): install outcomes as they happen, serving stats every
`report_interval_s`, queued on disk while the control plane is unreachable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc

from contract.assignment import (
    AssignmentRejected,
    VerifiedAssignment,
    new_nonce,
    verify_sync,
)
from contract.attribute_messages import attributes_pb
from contract.device_client import DeviceCallError, DeviceConnection, backoff_s, open_channel
from contract.pinned_keys import PinnedKeyRing
from contract.server_clock import ServerClock, skew_notice, skewed
from contract.transport import ClientTls, is_plaintext
from device_agent.agent_serving import ServingSlots
from device_agent.clock_reading import load_reading, save_reading
from device_agent.device_facts import detected, with_detected
from device_agent.device_keys import DeviceKeys
from device_agent.install import Installer, InstallOutcome
from device_agent.llm_serving import LlmServing
from device_agent.local_quotas import AppLimits
from device_agent.pipelines import Pipelines
from device_agent.report_outbox import (
    Collector,
    Outbox,
    install_report,
    open_outbox,
)
from device_agent.reporting import AUTH_CODES, Reporter
from device_agent.serving import Serving
from device_agent.state import AgentError, Identity, StateDir
from protos import device_pb2

log = logging.getLogger("skiff.agent")

# A Watch stream that stayed up this long was healthy: the next failure starts backoff over.
STABLE_S = 10.0
# After a failed sync the next try comes after 10 s, 20 s, ... up to the poll interval.
RETRY_BASE_S = 5.0
REPORT_INTERVAL_S = 60.0
# On SIGTERM: how long in-flight local requests may finish (reports: FLUSH_ON_STOP_S).
DRAIN_S = 10.0
SYNC_ON_STOP_S = 5.0


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


class Agent(ServingSlots):
    """One device's agent over a locked state directory."""

    def __init__(
        self,
        state: StateDir,
        server: str,
        *,
        tls: ClientTls | None = None,
        enroll_token: str = "",
        attributes: dict | None = None,
        serve: bool = False,
        report_interval_s: float = REPORT_INTERVAL_S,
        clock: Callable[[], float] = time.time,
        app_limits: AppLimits | None = None,
    ) -> None:
        """`clock` is the device's wall clock (Unix seconds); tests set it hours off."""
        self.state = state
        self.server = server
        self._tls = tls
        self._enroll_token = enroll_token
        self._attributes = attributes
        self._serve = serve
        self.report_interval_s = report_interval_s
        self._app_limits = app_limits
        self._channel: grpc.aio.Channel | None = None
        self._conn: DeviceConnection | None = None
        self._keys: DeviceKeys | None = None
        self.identity: Identity | None = None
        self.installer: Installer | None = None
        self.reporter: Reporter | None = None
        # The control plane's time, measured at every accepted answer.
        self.server_clock = ServerClock(clock)
        self._skew_said: float | None = None
        self.collector = Collector(self.server_clock)
        self.serving: Serving | None = None
        self.pipelines: Pipelines | None = None
        self.llm_serving: LlmServing | None = None
        self.reachable = False
        self._sync_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._background: set[asyncio.Task] = set()
        self.last: SyncOutcome | None = None
        # Status reads the state directory here (ServingSlots.status); no thread until then.
        self._status_pool = ThreadPoolExecutor(1, thread_name_prefix="skiff-status")
        self._status_reading: asyncio.Future | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def __aenter__(self) -> Agent:
        from runtime.hardening import forbid_core_dumps

        # Before any artifact is decrypted: no core file may ever carry a plaintext model.
        forbid_core_dumps()
        self.state.lock()
        stored = load_reading(self.state.path)
        if stored is not None:  # until this run's first answer: the last run's offset
            self.server_clock.assume_offset(stored.offset_s)
        try:
            self._channel = open_channel(self.server, self._tls)
            self.identity = await self._identity()
            self._keys = DeviceKeys(
                self.identity.device_id, self.identity.private_keyset, self.state.identity_file
            )
        except BaseException:
            await self.close()
            raise
        self._conn = self._connection(self.identity.credential)
        self._loop = asyncio.get_running_loop()
        try:
            outbox = open_outbox(self.state.path / "telemetry.db")
        except OSError as exc:
            await self.close()
            raise AgentError(f"telemetry queue: {exc}") from None
        if self._serve:
            self.serving = Serving(self.collector, self._failing)
            self.llm_serving = LlmServing(self.collector, self._failing)
            self.pipelines = Pipelines(self.serving, self.collector, limits=self._app_limits)
        self.reporter = Reporter(
            outbox,
            self.collector,
            self._conn.report,
            interval_s=self.report_interval_s,
            collect_events=self.serving.collect_events if self.serving else None,
            reached=self._reached,
        )
        on_activated = self._activate if self.pipelines else None
        self.installer = Installer(self.state, self._unwrap, on_activated)
        try:
            installed = bool(self.installer.active())
        except AgentError:  # a damaged install pointer: named where it is read, as before
            installed = False
        if installed:  # serving what is installed unwraps its keys
            try:
                await asyncio.to_thread(self._keys.load)
            except BaseException:
                await self.close()
                raise
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop serving, close the channel and let go of the state directory."""
        if self.serving is not None:
            await asyncio.to_thread(self.serving.close)
            await asyncio.to_thread(self.llm_serving.close)
        if self.reporter is not None:
            self.reporter.outbox.close()
            self.reporter = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._status_pool.shutdown(wait=False, cancel_futures=True)
        self.state.unlock()

    def _connection(self, credential: str = "") -> DeviceConnection:
        plaintext = is_plaintext(self.server, self._tls)
        return DeviceConnection(self._channel, credential, address=self.server, plaintext=plaintext)

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
        from device_agent.device_keys import new_key_pair

        # The private half never leaves the state dir (made in a child: no Tink here).
        private_keyset, public_keyset = await asyncio.to_thread(new_key_pair)
        attributes = self._attributes or {}
        conn = self._connection()
        try:
            reply = await conn.enroll(
                self._enroll_token, attributes_pb(self._reported(attributes)), public_keyset
            )
        except DeviceCallError as exc:
            if exc.code in AUTH_CODES or exc.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise Refused(f"enrollment refused: {exc.message}") from None
            raise
        identity = Identity(
            server=self.server,
            device_id=reply.device_id,
            credential=reply.credential,
            private_keyset=private_keyset,
            pinned=PinnedKeyRing.from_enrollment(reply, self.server_clock.now_datetime()),
            attributes=attributes,
        )
        self.state.save_identity(identity)
        log.info("enrolled as %s", identity.device_id)
        return identity

    def _unwrap(self, wrapped: bytes, version_uid: str) -> bytes:
        return self._keys.unwrap(wrapped, version_uid)

    # -- sync --------------------------------------------------------------------------------

    async def sync_once(self) -> SyncOutcome:
        """Sync, install what changed; errors are recorded in sync.json and raised."""
        async with self._sync_lock:
            sync = self.state.load_sync()
            try:
                outcome = await self._sync(sync.revision)
            except DeviceCallError as exc:
                self.reachable = False
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

    def _reported(self, attributes: dict) -> dict:
        """Return the operator's attributes over what this device detects (device fit)."""
        return with_detected(
            attributes, detected(self.state.path, self.state.artifacts, self.state.chunks)
        )

    async def _sync(self, last_revision: int) -> SyncOutcome:
        installed = [
            device_pb2.InstalledModel(model=name, version=v, variant=variant)
            for name, (v, variant) in sorted(self.installer.active().items())
        ]
        nonce = new_nonce()
        sent = self.server_clock.monotonic()
        response = await self._conn.sync(
            attributes_pb(self._reported(self.identity.attributes)),
            installed,
            last_revision,
            nonce=nonce,
        )
        received = self.server_clock.monotonic()
        self.reachable = True
        # Keys are judged on the control plane's time as last measured (the wall clock
        # before any measurement); expiry on the answer's own signed time.
        now = self.server_clock.now_datetime()
        pinned = self.identity.pinned.update(response.signing_keys, now)
        try:
            assignment = verify_sync(
                response,
                device_id=self.identity.device_id,
                nonce=nonce,
                keys=pinned.valid_keys(now),
                last_revision=last_revision,
                round_trip_s=received - sent,
            )
        except AssignmentRejected as exc:
            log.warning("assignment refused: %s", exc)
            raise
        self._measure_clock(assignment, sent, received)
        await self._ack(response)
        if pinned != self.identity.pinned:  # learnt an endorsed rotation
            self.identity = Identity(**{**self.identity.__dict__, "pinned": pinned})
            self.state.save_identity(self.identity)
        desired = {name: (m.version, m.variant) for name, m in assignment.models.items()}
        outcome = SyncOutcome(assignment.revision, desired)
        for _, m in sorted(assignment.models.items()):
            done = await self.installer.install(self._conn, m)
            outcome.installs.append(done)
            if done.new:  # queued at once: a later model's failure must not lose it
                self.queue_installs([install_report(done, self.server_clock.now())])
            if done.probes_pending and self.serving is not None:
                self._spawn(self._probe_rest(m.model, m.uid))
        for name in set(self.installer.pointers()) - set(assignment.models):
            self.installer.remove(name)
            if self.serving is not None:
                self.pipelines.drop(name)
                await asyncio.to_thread(self.serving.drop, name)
                await asyncio.to_thread(self.llm_serving.drop, name)
        assigned = set()
        for m in assignment.models.values():
            assigned.add(m.ciphertext_sha256)
            if m.golden is not None:
                assigned.add(m.golden.ciphertext_sha256)
            if m.chunks is not None and m.chunk_keys is not None:
                # A failed install's verified chunks stay, as a partial download does.
                assigned.add(m.chunk_keys.ciphertext_sha256)
                assigned.update(c.hex() for c in m.chunks.distinct())
        self.installer.collect_garbage(assigned)
        sync = self.state.load_sync()
        failures = [f"{o.model}: {o.reason}" for o in outcome.installs if o.result == "failed"]
        sync = sync.synced(assignment.revision, response.poll_interval_s)
        if failures:
            sync = sync.failed("; ".join(failures))
        self.state.save_sync(sync)
        return outcome

    def _measure_clock(self, assignment: VerifiedAssignment, sent: float, received: float) -> None:
        """Take the control plane's time from an accepted answer; say a large offset once."""
        if assignment.issued_at is None:
            return
        reading = self.server_clock.measure(assignment.issued_at.timestamp(), sent, received)
        self._skew_said, line = skew_notice(self._skew_said, reading.offset_s)
        if line:
            log.log(logging.WARNING if skewed(reading.offset_s) else logging.INFO, line)
        save_reading(self.state.path, reading)

    async def _ack(self, response: device_pb2.SyncResponse) -> None:
        """Tell the control plane this answer was accepted (it then counts us synced)."""
        try:
            await self._conn.ack(response.document, response.document_signature)
        except DeviceCallError as exc:
            if exc.code in AUTH_CODES:
                raise
            # The install goes ahead; the next accepted answer is acknowledged again.
            log.warning("could not acknowledge revision %d: %s", response.revision, exc.message)

    # -- daemon ------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Stay in sync (and serve) until `stop` is set; Refused ends it (revoked device).

        On stop, in-flight local requests get DRAIN_S to finish and queued reports
        FLUSH_ON_STOP_S to reach the control plane before the agent lets go.
        """
        api = None
        if self.serving is not None:
            from device_agent.local_api import AgentServicer, start_local_api

            servicer = AgentServicer(
                self.serving, self.status, self.pipelines, llm_serving=self.llm_serving
            )
            api, _ = await start_local_api(self.state.path, servicer)
            self._spawn(self._load_installed())
        tasks = [
            asyncio.create_task(self._watch_loop(), name="watch"),
            asyncio.create_task(self._poll_loop(), name="poll"),
            asyncio.create_task(self.reporter.loop(), name="report"),
        ]
        stopper = asyncio.create_task(stop.wait(), name="stop")
        try:
            done, _ = await asyncio.wait([stopper, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stopper:
                    task.result()  # a loop ends only by raising Refused
        finally:
            # A sync in progress may have just activated a version: let it finish (and queue
            # that install's report) rather than cancel it between the two, for at most
            # SYNC_ON_STOP_S (a longer one is downloading, and has activated nothing yet).
            if self._sync_lock.locked():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._sync_lock.acquire(), SYNC_ON_STOP_S)
                    self._sync_lock.release()  # no await until the cancels below: none runs
            for task in [stopper, *tasks, *self._background]:
                task.cancel()
            await asyncio.gather(stopper, *tasks, *self._background, return_exceptions=True)
            if api is not None:
                self.pipelines.close()  # subscriptions end: they must not hold the drain
                await api.stop(DRAIN_S)  # refuses new requests, lets running ones finish
                servicer.close()
            await self.reporter.final()

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- telemetry ----------------------------------------------------------------------------

    @property
    def outbox(self) -> Outbox | None:
        """The telemetry queue (None outside `async with`)."""
        return self.reporter.outbox if self.reporter is not None else None

    def queue_installs(self, reports: list[device_pb2.InstallReport]) -> None:
        """Queue install outcomes for the control plane and send them soon."""
        if self.reporter is not None:
            self.reporter.queue_installs(reports)

    async def flush_reports(self) -> int:
        """Send queued telemetry now; return how many batches the control plane took."""
        return await self.reporter.flush() if self.reporter is not None else 0

    def _reached(self, ok: bool) -> None:
        self.reachable = ok

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
                    self.reachable = True
                    if revision > self.state.load_sync().revision:
                        await self._try_sync()
            except DeviceCallError as exc:
                if exc.code in AUTH_CODES:
                    raise Refused(f"the control plane refuses this device: {exc.message}") from None
                self.reachable = False
                log.info("watch stream ended: %s", exc.message)
            if loop.time() - started > STABLE_S:
                attempt = 0
            await asyncio.sleep(backoff_s(attempt))
            attempt += 1


def _jittered(interval_s: float) -> float:
    """Spread polls over ±10% so a fleet restarted together does not poll together."""
    return max(1.0, interval_s) * random.uniform(0.9, 1.1)
