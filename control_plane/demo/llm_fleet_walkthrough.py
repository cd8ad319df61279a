"""`skiff demo --real-models`: a language model's rollout halted by its tokens per second.

A new SmolLM2 version (its q4 bundle) goes to simulated Android phones already running
the first one, guarded by `decode_tps_ratio<0.9` and `ttft_p95_ratio>1.2` and sliced by
SoC. The simulator makes the new version decode 40% slower on one SoC (`decode_x` 0.6);
the guard rolls that SoC back on its own by the figures the phones report (decode time
per token and time to first token of each generation), while the other SoCs go on.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

from contract import errors
from contract.transport import ClientTls
from control_plane.api.client import AdminClient
from control_plane.demo.fleet_walkthrough import follow, injected_profile
from control_plane.sim.fleet import FleetSimulator
from control_plane.views import fleet_text
from protos import fleet_pb2

__all__ = ["run_llm_fleet_demo"]

FLEET_SIZE = 150
SELECTOR = "platform=android"
SLOW_SOC = "sm8550"
DECODE_X = 0.6
HALT = ("decode_tps_ratio<0.9", "ttft_p95_ratio>1.2")
BAKE_S = 15


def run_llm_fleet_demo(
    client: AdminClient,
    address: str,
    tls: ClientTls,
    *,
    model: str,
    old: int,
    new: int,
    say: Callable[[str], None],
    loops: list,
    variant: str = "q4",
) -> dict:
    """Roll `model:new` out to simulated phones on `model:old`; return the figures.

    The event loop it runs is appended to `loops`, for the caller to close once the
    server has stopped (as `fleet_walkthrough` does: gRPC's poller may still hand it
    events from the simulator's closed channels).
    """
    loop = asyncio.new_event_loop()
    loops.append(loop)
    return loop.run_until_complete(
        _demo(client, address, tls, model=model, old=old, new=new, variant=variant, say=say)
    )


async def _demo(client, address, tls, *, model, old, new, variant, say) -> dict:
    def call(fn, *args, **kwargs):
        return asyncio.to_thread(fn, *args, **kwargs)

    figures: dict = {}
    token = (await call(client.create_enrollment_token, uses=FLEET_SIZE)).token
    slow = {"select": f"soc={SLOW_SOC}", "model": f"{model}:{new}", "decode_x": DECODE_X}
    profile = injected_profile(slow)
    async with FleetSimulator([address], seed=11, tls=tls, profile=profile) as sim:
        started = time.monotonic()
        await sim.enroll(FLEET_SIZE, token)
        await sim.sync_all()
        sim.watch_all()
        phones = [d for d in sim.devices if d.identity.attributes.get("platform") == "android"]
        await _until(sim, lambda: all(d.installed.get(model, (0,))[0] == old for d in phones))
        say(
            f"\n== {len(phones)} simulated Android phones (of {FLEET_SIZE} devices) run "
            f"{model}:{old} ({time.monotonic() - started:.1f}s); each reports its generations"
        )
        sim.report_all(1.0, requests_per_s=10)
        rollout = await call(
            client.create_rollout,
            fleet_pb2.CreateRolloutRequest(
                model=model,
                version=new,
                variant=variant,
                selector=SELECTOR,
                stages=[30, 100],
                bake_s=BAKE_S,
                halt=list(HALT),
                min_devices=3,
                min_inferences=300,
                slice_by="soc",
                reason="demo: guarded by tokens per second",
            ),
        )
        say(
            f"== rollout {rollout.id}: {model}:{new} ({variant}) to `{SELECTOR}` in stages 30%,"
            f" 100%, halted by {', '.join(HALT)}, sliced by soc\n"
            f"   the simulator makes {model}:{new} decode {1 / DECODE_X:.2g}x slower on "
            f"{SLOW_SOC} (decode_x {DECODE_X})"
        )
        started = time.monotonic()

        def on_event(e) -> None:
            if e.action != "slice_rollback":
                return
            figures["llm_guard_rollback_s"] = round(time.monotonic() - started, 1)
            evidence = json.loads(e.evidence_json) if e.evidence_json else {}
            c, b = evidence.get("candidate", {}), evidence.get("baseline", {})
            if c.get("decode_tps") and b.get("decode_tps"):
                figures["llm_guard_tps_ratio"] = round(c["decode_tps"] / b["decode_tps"], 3)
                say(
                    f"           evidence: {c['decode_tps']:.1f} tokens/s on {c['devices']} "
                    f"candidate phones vs {b['decode_tps']:.1f} on {b['devices']} baseline ones"
                )

        shown = await follow(
            call, client, rollout.id, started=started, timeout_s=240, on_event=on_event
        )
        await sim.stop_reporting()
        figures["llm_guard_state"] = shown.state

        def settled(d) -> bool:
            if d.identity.attributes.get("platform") != "android":
                return True
            want = old if d.identity.attributes.get("soc") == SLOW_SOC else new
            return d.installed.get(model, (0,))[0] == want

        await _until(sim, lambda: all(settled(d) for d in sim.devices))
        say(f"   every {SLOW_SOC} phone is back on {model}:{old}; the other SoCs run {model}:{new}")
        say("\n" + fleet_text.rollout_text(shown))
    return figures


async def _until(sim: FleetSimulator, done: Callable[[], bool], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise errors.Unavailable(f"the simulated phones did not converge in {timeout}s")
        await asyncio.sleep(0.2)
