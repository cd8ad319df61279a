"""The fleet half of `skiff demo`: a staged rollout, a rollback, then a guarded rollout.

Simulated devices and real agent processes converge to each stage and come back after
the rollback. It runs against a control plane the demo started: the operator's calls go
through the same admin client as the CLI; the simulated devices are the fleet
simulator's, real gRPC clients that verify, download, decrypt and report what they
install; the agents are `skiff agent run` processes that also serve the model (see
`device_walkthrough` for what apps do with them while version 2 is out). Last, the
simulated devices report serving telemetry (version 2 made 3x slower on one SoC by the
simulator's fault injection) and a rollout guarded by halt rules and sliced by SoC rolls
that SoC back on its own while the rest completes.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from contract import errors
from contract.transport import ClientTls
from control_plane.api.client import AdminClient
from control_plane.demo.demo_agents import DemoAgents
from control_plane.sim.fleet import FleetSimulator
from control_plane.sim.profile import parse_profile
from control_plane.views import fleet_text as fleet_views
from protos import fleet_pb2

FLEET_SIZE = 300
STAGES = (10.0, 50.0, 100.0)
SELECTOR = "platform=android"
SLOW_SOC = "sm8550"  # where the guarded rollout's version is slow (injected)
HALT = ("p95_latency_ratio>1.2", "crash_rate>0.001")


def _say(text: str) -> None:
    print(text, flush=True)


# Real agents: name -> attributes. Two match the rollout's selector, one does not.
AGENTS = {
    "agent-1": {"platform": "android", "region": "eu"},
    "agent-2": {"platform": "android", "region": "us"},
    "agent-3": {"platform": "ios", "region": "eu"},
}


@dataclass
class FleetDemo:
    """Where the fleet demo runs, and what it found (for the summary)."""

    client: AdminClient
    address: str
    tls: ClientTls
    ca: Path | None  # what the agents trust (the demo home's CA)
    agents_root: Path
    figures: dict = field(default_factory=dict)
    loops: list = field(default_factory=list)  # closed by the caller, after the server


def run_fleet_demo(
    demo: FleetDemo, *, model: str, old: int, new: int, while_out: Callable | None = None
) -> None:
    """Roll `model` out: `old` everywhere, then `new` in stages, then roll back.

    `while_out(agents)` runs while `new` is out on every selected device: the demo shows
    apps using it through the agents there.
    """
    client = demo.client
    base = client.create_rollout(fleet_pb2.CreateRolloutRequest(model=model, version=old))
    client.transition_rollout(base.id, "promote", "baseline for the whole fleet")
    _say(f"\n== rollout {base.id}: {model}:{old} to the whole fleet (completed)")
    token = client.create_enrollment_token(uses=FLEET_SIZE + len(AGENTS)).token
    with DemoAgents(demo.address, demo.ca, token, demo.agents_root, AGENTS) as agents:
        started = time.monotonic()
        agents.wait(lambda a: a.serving(model) == old, f"serving {model}:{old}")
        demo.figures["agents_ready_s"] = time.monotonic() - started
        for a in agents.agents:
            attrs = ", ".join(f"{k}={v}" for k, v in a.attributes.items())
            _say(f"   {a.name} ({attrs}): device {a.device_id()[:12]}… serving {model}:{old}")
        ready = demo.figures["agents_ready_s"]
        _say(f"   {len(AGENTS)} agent processes up and serving in {ready:.1f}s")
        # Not asyncio.run: the loop stays open (idle) until the agents and the server are
        # done, since gRPC's poller may still hand it events from the simulator's closed
        # channels; a closed loop would log each as an error.
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(
                _fleet_demo(demo, agents, model=model, old=old, new=new, while_out=while_out)
            )
        finally:
            demo.loops.append(loop)


async def _fleet_demo(
    demo: FleetDemo, agents: DemoAgents, *, model: str, old: int, new: int, while_out
):
    client = demo.client
    call = _blocking(client)
    token = (await call(client.create_enrollment_token, uses=FLEET_SIZE)).token
    profile = _slow_on(model, new, SLOW_SOC)
    async with FleetSimulator([demo.address], seed=7, tls=demo.tls, profile=profile) as sim:
        started = time.monotonic()
        await sim.enroll(FLEET_SIZE, token)
        await sim.sync_all()
        sim.watch_all()
        await _until(sim, lambda d: d.installed.get(model) == (old, "fp32"), timeout=60)
        _say(
            f"   {FLEET_SIZE} simulated devices enrolled and running {model}:{old} "
            f"in {time.monotonic() - started:.1f}s"
        )
        started = time.monotonic()
        staged = await _staged_rollout(sim, agents, call, client, model=model, version=new)
        demo.figures["rollout_s"] = time.monotonic() - started
        demo.figures["rollout_id"] = staged.id
        if while_out is not None:
            await asyncio.to_thread(while_out, agents)
        await call(client.transition_rollout, staged.id, "rollback", "demo: roll it back")
        _say(f"\n== skiff rollout rollback {staged.id}")
        started = time.monotonic()
        await _until(sim, lambda d: d.installed.get(model) == (old, "fp32"), timeout=60)
        await asyncio.to_thread(
            agents.wait, lambda a: a.serving(model) == old, f"back on {model}:{old}"
        )
        demo.figures["rollback_s"] = time.monotonic() - started
        _say(
            f"   every device is back on {model}:{old}, the {len(AGENTS)} agents included "
            f"({demo.figures['rollback_s']:.1f}s after the rollback)"
        )
        for a in agents.agents:
            _say(f"   {a.name}: serving {model}:{a.serving(model)}")
        shown = await call(client.get_rollout, staged.id)
        _say("\n" + fleet_views.rollout_text(shown))
        await _guarded_rollout(demo, sim, call, model=model, old=old, new=new)


GUARD_BAKE_S = 15


def _slow_on(model: str, version: int, soc: str):
    """Return the default device profile, with `model:version` 3x slower on `soc`."""
    return injected_profile(
        {"select": f"soc={soc}", "model": f"{model}:{version}", "latency_x": 3.0}
    )


def injected_profile(*rules: dict):
    """Return the simulator's default device profile with `rules` injected (sim.load)."""
    doc = json.loads(
        resources.files("control_plane.sim").joinpath("default_profile.json").read_text()
    )
    doc["inject"] = list(rules)
    return parse_profile(doc, source="demo profile")


async def follow(
    call, client: AdminClient, rollout_id: str, *, started: float, timeout_s: float, on_event=None
):
    """Print a rollout's audit as it happens until it completes or stops; return it.

    `on_event(entry)` is called for each audit entry after it is printed.
    """
    seen, deadline = 0, time.monotonic() + timeout_s
    while True:
        shown = await call(client.get_rollout, rollout_id)
        for e in shown.audit[seen:]:
            what = f"{e.slice}: " if e.slice else ""
            _say(
                f"   {time.monotonic() - started:5.1f}s  {e.actor:<10} {e.action:<15} "
                f"{what}{e.reason or e.to_state}"
            )
            if on_event is not None:
                on_event(e)
        seen = len(shown.audit)
        if shown.state in ("completed", "paused", "rolled_back"):
            return shown
        if time.monotonic() > deadline:
            raise errors.Unavailable(
                f"the guarded rollout did not finish in {timeout_s:g}s: {shown.state}"
            )
        await asyncio.sleep(0.5)


async def _guarded_rollout(demo: FleetDemo, sim: FleetSimulator, call, *, model, old, new):
    client = demo.client
    sim.report_all(1.0, requests_per_s=200)
    request = fleet_pb2.CreateRolloutRequest(
        model=model,
        version=new,
        selector=SELECTOR,
        stages=[20, 100],
        # Long enough for the slow SoC's first-stage devices to reach the sample the
        # guard needs: at 100% no device is left to compare a slice with, so a slice
        # that is not judged in the first stage never is (a loaded machine reports slower).
        bake_s=GUARD_BAKE_S,
        halt=list(HALT),
        min_devices=5,
        min_inferences=500,
        slice_by="soc",
        reason="demo: guarded",
    )
    started = time.monotonic()
    rollout = await call(client.create_rollout, request)
    _say(
        f"\n== rollout {rollout.id}: {model}:{new} to `{SELECTOR}` again, in stages 20%, 100%"
        f" ({GUARD_BAKE_S} s bake), halted by {', '.join(HALT)}, sliced by soc\n"
        f"   the simulated devices report latency and crashes every second; {model}:{new} is"
        f" 3x slower on {SLOW_SOC} (the simulator injects it)"
    )

    def on_event(e) -> None:
        if e.action != "slice_rollback":
            return
        demo.figures["guard_rollback_s"] = time.monotonic() - started
        evidence = json.loads(e.evidence_json) if e.evidence_json else {}
        c, b = evidence.get("candidate", {}), evidence.get("baseline", {})
        if c.get("p95_us") and b.get("p95_us"):
            demo.figures["guard_ratio"] = c["p95_us"] / b["p95_us"]
            _say(
                f"           evidence: p95 {c['p95_us']:,.0f} us on {c['devices']} "
                f"candidate devices vs {b['p95_us']:,.0f} us on {b['devices']} baseline"
            )

    shown = await follow(
        call, client, rollout.id, started=started, timeout_s=180, on_event=on_event
    )
    await sim.stop_reporting()
    demo.figures["guard_rollout_id"] = rollout.id
    demo.figures["guard_s"] = time.monotonic() - started
    demo.figures["guard_state"] = shown.state

    def settled(d) -> bool:  # the slow SoC back on `old`, the other selected ones on `new`
        attrs = d.identity.attributes
        if attrs.get("platform") != "android":
            return True
        want = old if attrs.get("soc") == SLOW_SOC else new
        return d.installed.get(model, (0, ""))[0] == want

    await _until(sim, settled, timeout=60)
    _say(f"   every {SLOW_SOC} device is back on {model}:{old}; the other SoCs run {model}:{new}")
    _say("\n" + fleet_views.rollout_text(shown))


async def _staged_rollout(
    sim: FleetSimulator, agents: DemoAgents, call, client: AdminClient, *, model, version
):
    request = fleet_pb2.CreateRolloutRequest(
        model=model, version=version, selector=SELECTOR, stages=list(STAGES), reason="demo"
    )
    rollout = await call(client.create_rollout, request)
    reach = await call(client.list_devices, SELECTOR)
    total = FLEET_SIZE + len(agents.agents)
    _say(
        f"\n== rollout {rollout.id}: {model}:{version} to `{SELECTOR}` "
        f"({len(reach)} of {total} devices) in stages {', '.join(f'{s:g}%' for s in STAGES)}"
    )
    simulated = {d.id for d in sim.devices}
    for index, pct in enumerate(STAGES):
        started = time.monotonic()
        devices = await call(client.list_devices, SELECTOR)
        chosen = {d.id for d in devices if d.desired[model].version == version}
        await sim.wait_synced(
            model, version, devices=chosen & simulated, installed=True, timeout=60
        )
        real = [a for a in agents.agents if a.device_id() in chosen]
        await asyncio.to_thread(
            agents.wait,
            lambda a, real=real: a not in real or a.serving(model) == version,
            f"serving {model}:{version}",
        )
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
    outside = [a.name for a in agents.agents if a.serving(model) != version]
    _say(
        f"   devices outside the selector stayed on their version: {len(others)} simulated"
        f" and {', '.join(outside) or 'no agent'}"
    )
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
