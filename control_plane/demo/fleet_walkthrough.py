"""The fleet half of `skiff demo`: a staged rollout, then a rollback.

Simulated devices converge to each stage and come back after the rollback. It runs
against a control plane the demo started: the operator's calls go through the same admin
client as the CLI, and the devices are the fleet simulator's, real gRPC clients that
verify, download, decrypt and report what they install.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from control_plane import errors
from control_plane.api.client import AdminClient
from control_plane.cli import fleet_views
from control_plane.sim.fleet import FleetSimulator
from device_agent.transport import ClientTls
from protos import fleet_pb2

FLEET_SIZE = 300
STAGES = (10.0, 50.0, 100.0)
SELECTOR = "platform=android"


def _say(text: str) -> None:
    print(text, flush=True)


def run_fleet_demo(
    client: AdminClient, address: str, tls: ClientTls, *, model: str, old: int, new: int
) -> None:
    """Roll `model` out to a simulated fleet: `old` everywhere, then `new` in stages."""
    asyncio.run(_fleet_demo(client, address, tls, model=model, old=old, new=new))


async def _fleet_demo(
    client: AdminClient, address: str, tls: ClientTls, *, model: str, old: int, new: int
):
    call = _blocking(client)
    base = await call(
        client.create_rollout, fleet_pb2.CreateRolloutRequest(model=model, version=old)
    )
    await call(client.transition_rollout, base.id, "promote", "baseline for the whole fleet")
    _say(f"\n== rollout {base.id}: {model}:{old} to the whole fleet (completed)")
    token = (await call(client.create_enrollment_token, uses=FLEET_SIZE)).token
    async with FleetSimulator([address], seed=7, tls=tls) as sim:
        started = time.monotonic()
        await sim.enroll(FLEET_SIZE, token)
        await sim.sync_all()
        sim.watch_all()
        await _until(sim, lambda d: d.installed.get(model) == (old, "fp32"), timeout=60)
        _say(
            f"   {FLEET_SIZE} simulated devices enrolled and running {model}:{old} "
            f"in {time.monotonic() - started:.1f}s"
        )
        staged = await _staged_rollout(sim, call, client, model=model, version=new)
        await call(client.transition_rollout, staged.id, "rollback", "demo: roll it back")
        _say(f"\n== skiff rollout rollback {staged.id}")
        started = time.monotonic()
        await _until(sim, lambda d: d.installed.get(model) == (old, "fp32"), timeout=60)
        _say(
            f"   every device is back on {model}:{old} "
            f"({time.monotonic() - started:.1f}s after the rollback)"
        )
    shown = await call(client.get_rollout, staged.id)
    _say("\n" + fleet_views.rollout_text(shown))


async def _staged_rollout(sim: FleetSimulator, call, client: AdminClient, *, model, version):
    request = fleet_pb2.CreateRolloutRequest(
        model=model, version=version, selector=SELECTOR, stages=list(STAGES), reason="demo"
    )
    rollout = await call(client.create_rollout, request)
    reach = await call(client.list_devices, SELECTOR)
    _say(
        f"\n== rollout {rollout.id}: {model}:{version} to `{SELECTOR}` "
        f"({len(reach)} of {FLEET_SIZE} devices) in stages {', '.join(f'{s:g}%' for s in STAGES)}"
    )
    for index, pct in enumerate(STAGES):
        started = time.monotonic()
        devices = await call(client.list_devices, SELECTOR)
        chosen = {d.id for d in devices if d.desired[model].version == version}
        await sim.wait_synced(model, version, devices=chosen, installed=True, timeout=60)
        shown = await call(client.get_rollout, rollout.id)
        c = shown.counts
        _say(
            f"   stage {index + 1} ({pct:g}%): {len(chosen)} devices installed {model}:{version}"
            f" in {time.monotonic() - started:.1f}s  (selected {c.selected}, in stage "
            f"{c.in_stage}, synced {c.synced}, installed {c.installed})"
        )
        if index + 1 < len(STAGES):
            await call(client.transition_rollout, rollout.id, "promote", "stage looks healthy")
    others = [d for d in sim.devices if d.installed.get(model, (0, ""))[0] != version]
    _say(f"   devices outside the selector stayed on their version: {len(others)}")
    return rollout


def _blocking(client: AdminClient) -> Callable:
    async def call(fn, *args, **kwargs):
        return await asyncio.to_thread(fn, *args, **kwargs)

    return call


async def _until(sim: FleetSimulator, done: Callable, *, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not all(done(d) for d in sim.devices):
        if time.monotonic() > deadline:
            missing = sum(not done(d) for d in sim.devices)
            raise errors.Unavailable(f"{missing} simulated devices did not converge in {timeout}s")
        await asyncio.sleep(0.1)
