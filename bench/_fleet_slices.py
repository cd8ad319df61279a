"""The simulated fleet of bench/propagation.py, in one process or split over several.

One Python process simulating 10k devices spends ~1.5-2.5 ms of CPU per device a promote
adds (verifying its answer, unwrapping its key, two gRPC calls): at a few thousand devices
it is the fleet, not the control plane, that sets the propagation figure. On a machine
with cores to spare, `--fleet-processes K` runs K slices of the fleet, one per process,
each enrolling and watching its own devices; the promote is timed by the parent.
Times are CLOCK_MONOTONIC readings, which every process of a Linux host shares.

A `FleetSlice` is the part of the fleet in this process; a `RemoteSlice` drives one in a
child process with the same (async) methods, so the scenario is written once.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import Sequence

from contract.transport import ClientTls
from control_plane.sim import FleetSimulator, SimOptions
from protos import fleet_pb2

MODEL = "det"
# After the last added device installed, how long the others are watched for a Sync they
# should not make (an unaffected device woken late still counts).
SETTLE_S = 2.0
WAIT_S = 300.0  # the longest a promote's devices are waited for


class FleetSlice:
    """Some of the fleet's devices, simulated in this process."""

    def __init__(
        self,
        addresses: Sequence[str],
        tls: ClientTls,
        *,
        seed: int,
        devices_per_channel: int,
        jitter_s: float,
        concurrency: int = SimOptions.concurrency,
    ) -> None:
        options = SimOptions(
            devices_per_channel=devices_per_channel,
            sync_jitter_s=jitter_s,
            concurrency=concurrency,  # Enroll and first Sync calls in flight at once
        )
        # Made in `start`, on the loop that runs it (grpc.aio binds to the first it meets).
        self._make = lambda: FleetSimulator(list(addresses), seed=seed, options=options, tls=tls)
        self._sim: FleetSimulator | None = None
        self._done: set[str] = set()  # devices the rollout reached so far
        self._added: set[str] = set()
        self._counts: dict[str, int] = {}
        self._cpu = 0.0

    async def start(self, n: int, token: str) -> float:
        """Enroll n devices, Sync each once, open every Watch; return enrollments/s."""
        self._sim = await self._make().__aenter__()
        started = time.perf_counter()
        await self._sim.enroll(n, token)
        rate = n / (time.perf_counter() - started)
        failed = await self._sim.sync_all()
        if failed:
            raise RuntimeError(f"{failed} devices could not sync")
        self._sim.watch_all()
        return rate

    async def first_stage(self, rollout: bytes) -> None:
        """Wait until the devices of the rollout's first stage installed it."""
        self._done = self._sim.in_stage(fleet_pb2.Rollout.FromString(rollout), 0)
        await self._sim.wait_synced(MODEL, 1, devices=self._done, installed=True, timeout=WAIT_S)

    async def arm(self, rollout: bytes, stage: int) -> int:
        """Get ready to time a promote to `stage`; return how many devices here it adds."""
        self._added = self._sim.in_stage(fleet_pb2.Rollout.FromString(rollout), stage) - self._done
        self._counts = self._sim.sync_counts()
        self._cpu = time.process_time()
        return len(self._added)

    async def installed(self) -> dict:
        """Wait for the armed promote's devices to Sync and install it.

        Returns when each Synced and installed it (monotonic readings), which replica
        each is on, and this process's CPU seconds since `arm`.
        """
        synced = await self._sim.wait_synced(MODEL, 1, devices=self._added, timeout=WAIT_S)
        installed = await self._sim.wait_synced(
            MODEL, 1, devices=self._added, installed=True, timeout=WAIT_S
        )
        return {
            "synced": synced,
            "installed": installed,
            "cpu_s": time.process_time() - self._cpu,
            "replica": {i: self._sim.address_of(i) for i in self._added},
        }

    async def settled(self) -> int:
        """Wait SETTLE_S; return how many devices outside the promote Synced since `arm`."""
        await asyncio.sleep(SETTLE_S)
        after = self._sim.sync_counts()
        woken = {i for i in after if after[i] != self._counts[i]} - self._added
        self._done |= self._added
        return len(woken)

    async def reached(self) -> set[str]:
        """Return the devices the rollout reached so far."""
        return set(self._done)

    async def close(self) -> None:
        if self._sim is not None:
            await self._sim.__aexit__(None, None, None)


class RemoteSlice:
    """A FleetSlice in a child process of its own (spawned: no gRPC state is forked)."""

    def __init__(self, *args, **kwargs) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child, args=(child, args, kwargs), daemon=True)
        self._proc.start()
        child.close()
        self._lock = asyncio.Lock()

    async def _call(self, name: str, *args):
        async with self._lock:
            await asyncio.to_thread(self._conn.send, (name, args))
            reply = await asyncio.to_thread(self._conn.recv)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def start(self, n: int, token: str) -> float:
        return await self._call("start", n, token)

    async def first_stage(self, rollout: bytes) -> None:
        await self._call("first_stage", rollout)

    async def arm(self, rollout: bytes, stage: int) -> int:
        return await self._call("arm", rollout, stage)

    async def installed(self) -> dict:
        return await self._call("installed")

    async def settled(self) -> int:
        return await self._call("settled")

    async def reached(self) -> set[str]:
        return await self._call("reached")

    async def close(self) -> None:
        try:
            await self._call("close")
        finally:
            await asyncio.to_thread(self._proc.join, 30)
            if self._proc.is_alive():
                self._proc.kill()


def _child(conn, args, kwargs) -> None:
    asyncio.run(_serve(conn, FleetSlice(*args, **kwargs)))


async def _serve(conn, fleet: FleetSlice) -> None:
    while True:
        try:
            name, args = await asyncio.to_thread(conn.recv)
        except EOFError:  # the parent went away
            await fleet.close()
            return
        try:
            reply = await getattr(fleet, name)(*args)
        except Exception as exc:  # noqa: BLE001 - the parent re-raises it
            reply = RuntimeError(f"fleet slice: {name}: {exc!r}")
        conn.send(reply)
        if name == "close":
            return
