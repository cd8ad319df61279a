"""Guardrails end to end: a simulated fleet reports, the control plane rolls the slow slice
back (or pauses the rollout) and lets the rest advance; on SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import subprocess
import time
from collections.abc import AsyncIterator

import pytest

from contract import errors
from control_plane.cli.fleet_views import rollout_dict
from control_plane.rollouts.lifecycle import bucket, stage_limit
from control_plane.sim import FleetSimulator, SimOptions
from control_plane.sim.profile import parse_profile
from protos import fleet_pb2
from tests.control_plane.cli.test_cli import skiff
from tests.control_plane.sim.conftest import MODEL, copy_home, serve, wait_for, wait_progressing
from tests.control_plane.sim.test_fleet import enrolled

FAST = SimOptions(devices_per_channel=8, sync_jitter_s=0.05)
SLOW_SOC, FAST_SOC = "sm8450", "sm8650"
N = 40  # 20 per SoC: a 50% stage holds at least 3 of each but for a 1-in-5000 draw
# Roll up and judge every fraction of a second, so a test takes seconds, not minutes.
QUICK = {"rollup_interval_s": 0.2, "guard_interval_s": 0.3, "scheduler_interval_s": 0.2}


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def guarded(request, template_home, tmp_path):
    if request.param == "sqlite":
        cp = serve(copy_home(template_home, tmp_path), **QUICK)
    else:
        home, url = request.getfixturevalue("pg_template")
        db = request.getfixturevalue("pg_copy")(url)
        cp = serve(copy_home(home, tmp_path), db=db, **QUICK)
    yield cp
    cp.stop()


def fleet_profile(inject: list) -> dict:
    devices = [
        {"attributes": {"platform": "android", "soc": soc, "device_model": f"Phone {i % 3}"}}
        for i, soc in enumerate([SLOW_SOC, FAST_SOC] * (N // 2))
    ]
    return {"devices": devices, "inject": inject}


def create(cp, version: int, **fields) -> fleet_pb2.Rollout:
    with cp.client() as client:
        return client.create_rollout(
            fleet_pb2.CreateRolloutRequest(model=MODEL, version=version, **fields)
        )


def show(cp, rollout_id: str) -> dict:
    with cp.client() as client:
        return rollout_dict(client.get_rollout(rollout_id))


def wait_completed(cp, rollout_id: str, stall_s: float = 90.0) -> dict:
    """Wait for the rollout to complete; return its `rollout show` document.

    Bounded by progress, not by a total: the wait runs on while each `stall_s` brings a new
    audit event (a stage advanced, a slice rolled back), which a loaded machine slows but
    does not stop. A rollout that settles in another state fails at once; either failure
    names where the rollout stood.
    """
    deadline, seen, doc = time.monotonic() + stall_s, -1, {}
    while time.monotonic() < deadline:
        doc = show(cp, rollout_id)
        if doc["state"] == "completed":
            return doc
        if doc["state"] not in ("active", "paused"):
            break
        if len(doc["audit"]) > seen:
            seen, deadline = len(doc["audit"]), time.monotonic() + stall_s
        time.sleep(0.1)
    health = {s["slice"]: s["state"] for s in doc.get("health", {}).get("slices", ())}
    raise AssertionError(
        f"rollout {rollout_id} did not complete: state {doc.get('state')!r}, "
        f"stage {doc.get('stage')}, audit {[e['action'] for e in doc.get('audit', ())]}, "
        f"slices {health}, overall {doc.get('health', {}).get('overall')}"
    )


def create_sliced(cp) -> fleet_pb2.Rollout:
    """Roll det:2 out in two stages, sliced by SoC, under latency and crash rules."""
    return create(
        cp,
        2,
        stages=[50, 100],
        bake_s=2,
        halt=["p95_latency_ratio>1.2", "crash_rate>0.01"],
        min_devices=3,
        min_inferences=300,
        slice_by="soc",
    )


@contextlib.asynccontextmanager
async def fleet_on_v1(cp, inject: list) -> AsyncIterator[FleetSimulator]:
    """N simulated devices with `inject`'s faults, all running and reporting det:1."""
    prof = parse_profile(fleet_profile(inject))
    async with FleetSimulator([cp.address], profile=prof, options=FAST, tls=cp.tls) as sim:
        await enrolled(sim, cp, N)
        await asyncio.to_thread(create, cp, 1)
        await sim.wait_synced(MODEL, 1, installed=True, timeout=30)
        sim.report_all(0.25, requests_per_s=300)
        yield sim


def test_a_slow_slice_is_rolled_back_while_the_rest_advances(guarded):
    cp = guarded
    inject = [{"select": f"soc={SLOW_SOC}", "model": f"{MODEL}:2", "latency_x": 3.0}]

    async def scenario() -> tuple[dict, dict]:
        async with fleet_on_v1(cp, inject) as sim:
            r = await asyncio.to_thread(create_sliced, cp)
            doc = await asyncio.to_thread(wait_completed, cp, r.id)
            socs = {d.id: d.identity.attributes["soc"] for d in sim.devices}
            fast = [i for i, soc in socs.items() if soc == FAST_SOC]
            slow = [i for i, soc in socs.items() if soc == SLOW_SOC]
            await sim.wait_synced(MODEL, 2, installed=True, devices=fast, timeout=30)
            # The slow slice went back to (or stayed on) what it ran without the rollout.
            await sim.wait_synced(MODEL, 1, installed=True, devices=slow, timeout=30)
            return doc, socs

    doc, _ = asyncio.run(scenario())
    events = [e for e in doc["audit"] if e["action"] == "slice_rollback"]
    assert [e["slice"] for e in events] == [f"soc={SLOW_SOC}"]
    (event,) = events
    assert event["actor"] == "guardrail"
    evidence = event["evidence"]
    assert evidence["failed"] == ["p95_latency_ratio>1.2"]
    (rule,) = [x for x in evidence["rules"] if x["rule"] == "p95_latency_ratio>1.2"]
    # 3x slower injected; judged as soon as the minimum sample is in, so the figure is rough
    assert rule["status"] == "fail" and rule["value"] > 1.5 and rule["bound"] > 1.2
    assert evidence["candidate"]["devices"] >= 3 and evidence["baseline"]["devices"] >= 3
    assert evidence["candidate"]["p95_us"] > 1.5 * evidence["baseline"]["p95_us"]
    # The fast slice advanced through both stages; show names each slice's state.
    assert [e["action"] for e in doc["audit"]].count("advance") == 2
    states = {s["slice"]: s["state"] for s in doc["health"]["slices"]}
    assert states[f"soc={SLOW_SOC}"] == "rolled_back" and states[f"soc={FAST_SOC}"] == "active"

    # An operator readmits the slice (a completed rollout's slices can be rolled back
    # or readmitted only while it runs: it says so).
    with cp.client() as client, pytest.raises(errors.FailedPrecondition) as refused:
        client.transition_rollout(doc["id"], "resume", "fixed", slice=f"soc={SLOW_SOC}")
    assert "completed" in str(refused.value) and f"--select soc={SLOW_SOC}" in str(refused.value)


def test_a_failing_rule_without_slices_pauses_the_rollout_and_a_short_sample_holds_it(guarded):
    cp = guarded
    inject = [{"select": "", "model": f"{MODEL}:2", "crash_rate": 0.05}]

    async def scenario() -> tuple[dict, dict]:
        async with fleet_on_v1(cp, inject):
            # Too few devices for the rule to judge: the stage bakes but does not advance.
            held = await asyncio.to_thread(
                create,
                cp,
                2,
                stages=[50, 100],
                bake_s=1,
                halt=["crash_rate>0.001"],
                min_devices=1000,
                priority=1,
            )
            await asyncio.sleep(3)
            held_doc = await asyncio.to_thread(show, cp, held.id)
            with cp.client() as client:
                client.transition_rollout(held.id, "rollback", "make way")
            r = await asyncio.to_thread(
                create,
                cp,
                2,
                stages=[50, 100],
                bake_s=60,
                halt=["crash_rate>0.001"],
                min_devices=3,
                min_inferences=300,
            )

            def paused():
                doc = show(cp, r.id)
                return doc if doc["state"] == "paused" else None

            return held_doc, await asyncio.to_thread(wait_for, paused, 60, "a guardrail pause")

    held, doc = asyncio.run(scenario())
    assert held["state"] == "active" and held["stage"] == 1  # numbered from 1
    (verdict,) = held["health"]["overall"]["rules"]
    assert verdict["status"] == "insufficient" and "1000 devices needed" in verdict["detail"]
    pause = [e for e in doc["audit"] if e["action"] == "pause"][-1]
    assert pause["actor"] == "guardrail" and "crash_rate" in pause["reason"]
    assert pause["evidence"]["failed"] == ["crash_rate>0.001"]
    assert pause["evidence"]["candidate"]["crashes"] > 0
    json.dumps(doc)  # what `rollout show --json` prints is plain JSON


def _cli(cp, *args: str) -> subprocess.CompletedProcess:
    """Run `skiff ...` against `cp` (its home, so its CA and token)."""
    env = {"SKIFF_HOME": str(cp.config.home), "SKIFF_SERVER": str(cp.address), "SKIFF_TOKEN": ""}
    return skiff(*args, env=env)


def test_a_readmitted_slice_is_judged_afresh_from_the_command_line(guarded):
    """The operator's whole path: create with guardrail flags, watch `rollout show`, readmit
    the rolled-back slice with `rollout resume ID --slice`; its devices get the version back,
    and the guard judges the slice again on what it reports from then on only."""
    cp = guarded
    inject = [{"select": f"soc={SLOW_SOC}", "model": f"{MODEL}:2", "latency_x": 3.0}]

    async def scenario() -> tuple[str, dict, str, dict, dict]:
        async with fleet_on_v1(cp, inject) as sim:
            created = await asyncio.to_thread(
                _cli,
                cp,
                *("rollout", "create", f"{MODEL}:2", "--stages", "50,100", "--bake", "1h"),
                *("--halt", "p95_latency_ratio>1.2", "--halt", "crash_rate>0.01"),
                *("--min-devices", "3", "--min-inferences", "300", "--slice-by", "soc", "--json"),
            )
            rid = json.loads(created.stdout)["id"]

            seen: list[dict] = []

            def slice_state(want: str, after: int = 0):
                doc = show(cp, rid)
                seen[:] = [doc]
                states = {s["slice"]: s["state"] for s in doc["health"]["slices"]}
                rollbacks = [e for e in doc["audit"] if e["action"] == "slice_rollback"]
                ok = states.get(f"soc={SLOW_SOC}") == want and len(rollbacks) >= after
                return doc if ok else None

            def progress() -> tuple:
                """What a verdict on the slow slice waits for: its reports, and the audit."""
                doc = seen[0] if seen else {}
                health = doc.get("health") or {}
                cohorts = [
                    (s["candidate"]["inferences"], s["baseline"]["inferences"])
                    for s in health.get("slices", ())
                    if s["slice"] == f"soc={SLOW_SOC}"
                ]
                return len(doc.get("audit", ())), cohorts

            def waited(want: str, after: int, stall_s: float, what: str):
                # Reports keep coming whether or not a verdict does: bounded at 3 minutes
                # (a verdict takes seconds once the minimum sample is in).
                try:
                    return wait_progressing(
                        lambda: slice_state(want, after), progress, stall_s, what, cap_s=180
                    )
                except AssertionError as stalled:  # say what the rollout looked like too
                    doc = seen[0] if seen else {}
                    slices = (doc.get("health") or {}).get("slices", [])
                    raise AssertionError(
                        f"{stalled}; state {doc.get('state')}, audit "
                        f"{[e['action'] for e in doc.get('audit', [])]}, slices "
                        + "; ".join(
                            f"{x['slice']} {x['state']} {x['candidate']['devices']} vs "
                            f"{x['baseline']['devices']} devices: "
                            + ", ".join(r.get("detail") or r["status"] for r in x["rules"])
                            for x in slices
                        )
                    ) from None

            first = await asyncio.to_thread(waited, "rolled_back", 1, 60, "the slice rolled back")
            slow = [d.id for d in sim.devices if d.identity.attributes["soc"] == SLOW_SOC]
            await sim.wait_synced(MODEL, 1, installed=True, devices=slow, timeout=30)
            text = (await asyncio.to_thread(_cli, cp, "rollout", "show", rid)).stdout
            resumed = await asyncio.to_thread(
                _cli,
                cp,
                *("rollout", "resume", rid, "--slice", f"soc={SLOW_SOC}"),
                *("--reason", "driver fixed", "--json"),
            )
            readmitted = json.loads(resumed.stdout)
            # Its devices in the stage run the version again; still slow, the slice goes
            # back again, judged on what they report from the readmission on.
            half = stage_limit([50.0, 100.0], 0)
            staged = [d for d in slow if bucket(rid, d) < half]
            await sim.wait_synced(MODEL, 2, installed=True, devices=staged, timeout=30)
            again = await asyncio.to_thread(waited, "rolled_back", 2, 60, "a second rollback")
            return rid, first, text, readmitted, again

    rid, first, text, readmitted, again = asyncio.run(scenario())
    assert first["guardrails"] == {
        "halt_rules": ["p95_latency_ratio>1.2", "crash_rate>0.01"],
        "min_devices": 3,
        "min_inferences": 300,
        "slice_by": "soc",
    }
    # `rollout show` (text) names each slice, its state and its figures.
    assert f"soc={SLOW_SOC}" in text and "rolled_back" in text and f"soc={FAST_SOC}" in text
    states = {s["slice"]: s["state"] for s in readmitted["health"]["slices"]}
    assert states[f"soc={SLOW_SOC}"] == "active"
    resume = readmitted["audit"][-1]
    assert (resume["action"], resume["slice"]) == ("slice_resume", f"soc={SLOW_SOC}")
    assert resume["reason"] == "driver fixed" and resume["actor"] == "admin"
    # The second verdict rests on reports made after the readmission only.
    second = [e for e in again["audit"] if e["action"] == "slice_rollback"][-1]
    at = dt.datetime.fromisoformat
    assert at(second["evidence"]["since"]) >= at(resume["at"]) and second["at"] >= resume["at"]
    assert second["evidence"]["failed"] == ["p95_latency_ratio>1.2"]
    assert again["state"] == "active"  # the other slice goes on
