"""The fleet simulator: thousands of devices over a few shared gRPC channels.

The Python API the CLI, the benchmarks and the demo use:

    async with FleetSimulator([address], profile=load_profile(), seed=0) as sim:
        await sim.enroll(1000, token)           # attributes drawn from the profile
        await sim.sync_all()
        sim.watch_all()
        times = await sim.wait_synced("det", 2, devices=ids, timeout=60)

Each channel is its own TCP connection (a local subchannel pool: by default gRPC would
fold every channel to one address into one connection) and carries `devices_per_channel`
devices, their credentials travelling with each call. With several addresses (replicas of
one control plane), channels take them in turn. `tls` is what the channels trust (see
contract.transport); a TLS handshake is per channel, so 10,000 devices over channels
of 500 cost 20 handshakes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import grpc

from contract import errors
from contract.device_client import (
    CHANNEL_OPTIONS,
    DeviceCallError,
    DeviceConnection,
    open_channel,
)
from contract.key_wrap import DeviceKeyPair
from contract.report_batches import FLUSH_ON_STOP_S, MAX_QUEUE_AGE_S, MAX_QUEUE_BYTES
from contract.transport import ClientTls
from control_plane.api.fleet_convert import attributes_pb
from control_plane.fleet.selector import parse_selector
from control_plane.rollouts.lifecycle import bucket, stage_limit
from control_plane.sim.artifacts import ArtifactCache
from control_plane.sim.device import SimDevice, Target
from control_plane.sim.outbox import ReportQueue
from control_plane.sim.profile import Profile, load_profile
from control_plane.sim.state import Identity
from control_plane.sim.stats import FleetStats, fleet_stats
from protos import fleet_pb2

SIM_CHANNEL_OPTIONS = [
    *CHANNEL_OPTIONS,
    # One connection per channel, so N channels are N connections like N device groups.
    ("grpc.use_local_subchannel_pool", 1),
    # Hundreds of devices share each connection; after a server restart they should not
    # all wait out gRPC's default reconnect backoff (up to 120 s): their own jittered
    # backoff already spreads the load.
    ("grpc.max_reconnect_backoff_ms", 5_000),
]


@dataclass(frozen=True)
class SimOptions:
    """How the simulated fleet behaves."""

    devices_per_channel: int = 500
    # Devices wait uniform(0, this) after a push before they Sync, so a fleet-wide change
    # is not one burst; it adds to propagation time.
    sync_jitter_s: float = 0.5
    # Enroll and Sync calls in flight at once in `enroll` and `sync_all`.
    concurrency: int = 128
    # Each device's queue of reports while the control plane is away: an agent's bounds.
    report_queue_bytes: int = MAX_QUEUE_BYTES
    report_queue_age_s: float = MAX_QUEUE_AGE_S


class FleetSimulator:
    """A simulated fleet; use as an async context manager (it owns channels and tasks)."""

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        profile: Profile | None = None,
        seed: int = 0,
        options: SimOptions | None = None,
        tls: ClientTls | None = None,
    ) -> None:
        if not addresses:
            raise errors.InvalidArgument("the simulator needs a control plane address")
        self.addresses = tuple(addresses)
        self.profile, self.seed = profile or load_profile(), seed
        self.options = options or SimOptions()
        self.tls = tls
        self.devices: list[SimDevice] = []
        self._address: dict[str, str] = {}
        self.cache = ArtifactCache()
        self._channels: list[grpc.aio.Channel] = []
        self._tasks: dict[str, asyncio.Task] = {}
        # Each wait_synced's (devices changed since it last looked, its wake-up): a waiter
        # looks again at what changed, not at the whole fleet on every Sync.
        self._waiters: list[tuple[set[str], asyncio.Event]] = []
        self._enrolling = 0  # devices `enroll` has yet to enroll (the live view counts them)

    async def __aenter__(self) -> FleetSimulator:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _channel(self, index: int) -> grpc.aio.Channel:
        n = index // self.options.devices_per_channel
        while len(self._channels) <= n:
            address = self._address_at(len(self._channels) * self.options.devices_per_channel)
            self._channels.append(open_channel(address, self.tls, SIM_CHANNEL_OPTIONS))
        return self._channels[n]

    def _address_at(self, index: int) -> str:
        n = index // self.options.devices_per_channel
        return self.addresses[n % len(self.addresses)]

    def address_of(self, device_id: str) -> str:
        """Return the control plane address (replica) a device talks to."""
        return self._address[device_id]

    def _notified(self, device: SimDevice) -> None:
        for touched, wake in self._waiters:
            touched.add(device.id)
            wake.set()

    def adopt(self, identities: Sequence[Identity]) -> list[SimDevice]:
        """Add already-enrolled devices (from a state file); returns them."""
        added = []
        for identity in identities:
            index = len(self.devices)
            outbox = ReportQueue(
                max_bytes=self.options.report_queue_bytes,
                max_age_s=self.options.report_queue_age_s,
            )
            device = SimDevice(
                identity,
                self._channel(index),
                cache=self.cache,
                notify=self._notified,
                outbox=outbox,
            )
            self._address[device.id] = self._address_at(index)
            self.devices.append(device)
            added.append(device)
        return added

    async def enroll(self, n: int, token: str) -> list[SimDevice]:
        """Enroll `n` new devices, attributes drawn from the profile; returns them.

        Device i of the fleet gets the profile's draw i for the seed, whatever ran before.
        The first enrolls alone so a refused token or an unreachable server fails once,
        clearly, instead of once per device.
        """
        start = len(self.devices)
        attrs = [self.profile.attributes(self.seed, start + i) for i in range(n)]
        if not attrs:
            return []
        self._enrolling = n
        try:
            first = await self._enroll_one(start, attrs[0], token)
        except BaseException as exc:  # cancelled too: nothing is enrolling any more
            self._enrolling = 0
            if isinstance(exc, DeviceCallError):
                raise _enroll_error(exc, self.addresses[0], enrolled=0) from None
            raise
        limit = asyncio.Semaphore(self.options.concurrency)
        slots: list[Identity | None] = [first] + [None] * (n - 1)

        async def one(i: int) -> None:
            async with limit:
                slots[i] = await self._enroll_one(start + i, attrs[i], token)

        try:
            results = await asyncio.gather(*(one(i) for i in range(1, n)), return_exceptions=True)
        finally:  # also when cancelled: keep whoever enrolled, their state is saved
            self._enrolling = 0
            added = self.adopt([s for s in slots if s is not None])
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise _enroll_error(failed[0], self.addresses[0], enrolled=len(added))
        return added

    async def _enroll_one(self, index: int, attrs: dict, token: str) -> Identity:
        keys = DeviceKeyPair.generate()
        conn = DeviceConnection(self._channel(index))
        reply = await conn.enroll(token, attributes_pb(attrs), keys.public_keyset())
        self._enrolling -= 1
        return Identity(
            device_id=reply.device_id,
            credential=reply.credential,
            private_keyset=keys.private_keyset(),
            attributes=attrs,
            signing_public_keys=tuple(reply.signing_public_keys),
            poll_interval_s=reply.poll_interval_s,
        )

    async def sync_all(self, devices: Sequence[SimDevice] | None = None) -> int:
        """Sync (and install) every device once, bounded in flight; returns failures."""
        limit = asyncio.Semaphore(self.options.concurrency)

        async def one(device: SimDevice) -> bool:
            async with limit:
                return await device.sync_retrying()

        chosen = self.devices if devices is None else devices
        results = await asyncio.gather(*(one(d) for d in chosen))
        return results.count(False)

    def watch_all(self) -> None:
        """Start every device's Watch loop (those already watching are left alone)."""
        for device in self.devices:
            task = self._tasks.get(device.id)
            if task is None or task.done():
                self._tasks[device.id] = asyncio.create_task(
                    device.watch_forever(self.options.sync_jitter_s), name=f"watch-{device.id}"
                )

    def report_all(self, interval_s: float, *, requests_per_s: float | None = None) -> None:
        """Have every device report its models' serving stats every `interval_s`.

        What they report follows `control_plane.sim.load` (each model served
        `requests_per_s`, by default REQUESTS_PER_S) and the profile's `inject` rules.
        """
        from control_plane.sim.load import REQUESTS_PER_S, Load

        for device in self.devices:
            key = f"report-{device.id}"
            task = self._tasks.get(key)
            if task is None or task.done():
                load = Load(
                    device.id,
                    device.identity.attributes,
                    self.seed,
                    requests_per_s or REQUESTS_PER_S,
                )
                self._tasks[key] = asyncio.create_task(
                    device.report_forever(load, interval_s, self.profile.injections), name=key
                )

    async def wait_synced(
        self,
        model: str,
        version: int,
        variant: str = "fp32",
        *,
        devices: Collection[str] | None = None,
        installed: bool = False,
        timeout: float = 60.0,
    ) -> dict[str, float]:
        """Wait until every device named (default: all) has synced (or installed) a version.

        Returns each device's time.monotonic() of its first Sync carrying the version (or
        of installing it). Unavailable, naming how many are missing, after `timeout`.
        """
        target = (model, version, variant)
        wanted = set(devices) if devices is not None else {d.id for d in self.devices}
        by_id = {d.id: d for d in self.devices if d.id in wanted}
        if len(by_id) != len(wanted):
            raise errors.InvalidArgument("wait_synced names devices this fleet does not have")
        deadline = time.monotonic() + timeout
        touched, wake = waiter = (set(), asyncio.Event())
        self._waiters.append(waiter)
        try:
            pending = {i for i in wanted if target not in _times(by_id[i], installed)}
            while pending:
                left = deadline - time.monotonic()
                try:
                    await asyncio.wait_for(wake.wait(), timeout=max(left, 0))
                except TimeoutError:
                    what = "installed" if installed else "synced"
                    raise errors.Unavailable(
                        f"{len(pending)} of {len(wanted)} devices have not {what} "
                        f"{model}:{version} ({variant}) after {timeout:g}s "
                        f"({_describe([by_id[i] for i in sorted(pending)[:3]])})"
                    ) from None
                wake.clear()
                pending -= {i for i in touched & pending if target in _times(by_id[i], installed)}
                touched.clear()
        finally:
            self._waiters.remove(waiter)
        return {i: _times(d, installed)[target] for i, d in by_id.items()}

    def in_stage(self, rollout: fleet_pb2.Rollout, stage: int) -> set[str]:
        """Return the devices of this fleet a rollout's `stage` (from 0) includes.

        Predicted here as the control plane decides it: the rollout's selector over each
        device's attributes and its sticky bucket against the stage's share.
        """
        selector = parse_selector(rollout.selector)
        limit = stage_limit(list(rollout.stages), stage)
        return {
            d.id
            for d in self.devices
            if selector.matches(d.identity.attributes) and bucket(rollout.id, d.id) < limit
        }

    def sync_counts(self) -> dict[str, int]:
        """Return how many Syncs each device has completed."""
        return {d.id: d.syncs for d in self.devices}

    def stats(self) -> FleetStats:
        """Count what the fleet is doing now."""
        return replace(fleet_stats(self.devices, self.cache), enrolling=max(self._enrolling, 0))

    async def stop_reporting(self, flush_s: float = FLUSH_ON_STOP_S) -> None:
        """Stop every device's report loop, then send what is queued (as agents do).

        A loop is cancelled where it waits (a Report cut short stays queued, and its
        resend is applied once); the queues then get at most `flush_s`.
        """
        tasks = [t for key, t in self._tasks.items() if key.startswith("report-")]
        for device in self.devices:
            device.stop_reports = True
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for key in [k for k in self._tasks if k.startswith("report-")]:
            del self._tasks[key]
        queued = [d for d in self.devices if len(d.outbox) and not d.rejected]
        if queued and flush_s > 0:
            flushes = [asyncio.create_task(d.flush_reports()) for d in queued]
            _, late = await asyncio.wait(flushes, timeout=flush_s)
            for task in late:
                task.cancel()
            await asyncio.gather(*flushes, return_exceptions=True)

    async def close(self) -> None:
        """Cancel every Watch loop and close the channels."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        await asyncio.gather(*(c.close() for c in self._channels), return_exceptions=True)
        self._channels.clear()


def _times(device: SimDevice, installed: bool) -> dict[Target, float]:
    return device.installed_at if installed else device.synced_at


def _enroll_error(exc: BaseException, address: str, *, enrolled: int) -> errors.SkiffError:
    note = f" ({enrolled} enrolled first)" if enrolled else ""
    if not isinstance(exc, DeviceCallError):
        return errors.SkiffError(f"enrollment failed: {exc}{note}")
    if exc.code == grpc.StatusCode.UNAVAILABLE:
        first = exc.message.splitlines()[0]
        return errors.Unavailable(f"control plane unreachable at {address}: {first}{note}")
    if exc.code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return errors.Unauthenticated(f"enrollment refused: {exc.message}{note}")
    return errors.SkiffError(f"enrollment failed: {exc}{note}")


def _describe(devices: Sequence[SimDevice]) -> str:
    """Say where a few lagging devices are, for a timeout's message."""
    now = time.monotonic()

    def pushed(d: SimDevice) -> str:
        if d.pushed is None:
            return "no revision pushed on this stream or any before"
        return f"revision {d.pushed[0]} pushed {now - d.pushed[1]:.1f} s ago"

    def syncing(d: SimDevice) -> str:
        if d.syncing_since is None:
            return ""
        return f", a Sync under way for {now - d.syncing_since:.1f} s"

    return "; ".join(
        f"{d.id}: revision {d.revision}, {'watching' if d.watching else 'not watching'}, "
        f"{pushed(d)}{syncing(d)}, {d.syncs} syncs, failed calls {dict(d.failures) or 'none'}"
        for d in devices
    )
