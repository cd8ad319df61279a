"""A language model's rollout rolled back by its tokens per second, end to end.

A tiny GGUF is pushed twice (converted in the registry's MNN child each time); simulated
phones install its bundles, and report generations as agents do (decode time per token,
time to first token, tokens). The second version decodes at half speed on one SoC: the
guard rolls that SoC back on `decode_tps_ratio<0.9` while the other completes, and the
time-to-first-token rule, which that slowdown barely moves, passes.
"""

from __future__ import annotations

import asyncio

import pytest

from control_plane.sim import FleetSimulator
from control_plane.sim.profile import parse_profile
from protos import fleet_pb2
from tests.control_plane.helpers import start_control_plane
from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gguf
from tests.control_plane.sim.conftest import wait_for
from tests.control_plane.sim.test_fleet import enrolled
from tests.control_plane.sim.test_guardrails import FAST, FAST_SOC, QUICK, SLOW_SOC, N, show

MODEL = "tiny"
RULES = ["decode_tps_ratio<0.9", "ttft_p95_ratio>1.2"]

pytestmark = pytest.mark.xdist_group("llm")


def test_a_slice_that_decodes_slower_is_rolled_back_by_its_tokens_per_second(tmp_path):
    cp = start_control_plane(tmp_path / "home", **QUICK)
    try:
        gguf = tmp_path / "tiny.gguf"
        write_tiny_gguf(gguf)
        with cp.client() as client:
            v1 = client.push(gguf, name=MODEL, variants=("q8",))
            v2 = client.push(gguf, name=MODEL, variants=("q8",), allow_duplicate=True)
        inject = [{"select": f"soc={SLOW_SOC}", "model": f"{MODEL}:2", "decode_x": 0.5}]
        doc = asyncio.run(_scenario(cp, inject, v1.version, v2.version))
    finally:
        cp.stop()
    events = [e for e in doc["audit"] if e["action"] == "slice_rollback"]
    assert [e["slice"] for e in events] == [f"soc={SLOW_SOC}"], doc["audit"]
    evidence = events[0]["evidence"]
    assert evidence["failed"] == ["decode_tps_ratio<0.9"]
    rules = {r["rule"]: r for r in evidence["rules"]}
    decode = rules["decode_tps_ratio<0.9"]
    assert decode["status"] == "fail" and decode["value"] < 0.7 and decode["bound"] < 0.9
    assert rules["ttft_p95_ratio>1.2"]["status"] != "fail"
    c, b = evidence["candidate"], evidence["baseline"]
    assert c["decode_tps"] < 0.7 * b["decode_tps"] and c["tokens_out"] > 0
    assert c["ttft_count"] > 0 and b["ttft_p95_ms"] > 0
    states = {s["slice"]: s["state"] for s in doc["health"]["slices"]}
    assert states == {f"soc={SLOW_SOC}": "rolled_back", f"soc={FAST_SOC}": "active"}


async def _scenario(cp, inject, old: int, new: int) -> dict:
    devices = [
        {"attributes": {"platform": "android", "soc": soc, "device_model": f"Phone {i % 3}"}}
        for i, soc in enumerate([SLOW_SOC, FAST_SOC] * (N // 2))
    ]
    prof = parse_profile({"devices": devices, "inject": inject})
    async with FleetSimulator([cp.address], profile=prof, options=FAST, tls=cp.tls) as sim:
        await enrolled(sim, cp, N)
        await asyncio.to_thread(_create, cp, old)
        await sim.wait_synced(MODEL, old, "q8", installed=True, timeout=60)
        assert all(d.llm_models == {MODEL} for d in sim.devices)
        sim.report_all(0.25, requests_per_s=100)
        r = await asyncio.to_thread(
            _create,
            cp,
            new,
            stages=[50, 100],
            bake_s=2,
            halt=RULES,
            min_devices=3,
            min_inferences=300,
            slice_by="soc",
        )

        def completed():
            doc = show(cp, r.id)
            return doc if doc["state"] == "completed" else None

        doc = await asyncio.to_thread(wait_for, completed, 120, "the rollout to complete")
        slow = [d.id for d in sim.devices if d.identity.attributes["soc"] == SLOW_SOC]
        fast = [d.id for d in sim.devices if d.identity.attributes["soc"] == FAST_SOC]
        await sim.wait_synced(MODEL, new, "q8", installed=True, devices=fast, timeout=30)
        await sim.wait_synced(MODEL, old, "q8", installed=True, devices=slow, timeout=30)
        return doc


def _create(cp, version: int, **fields) -> fleet_pb2.Rollout:
    with cp.client() as client:
        return client.create_rollout(
            fleet_pb2.CreateRolloutRequest(model=MODEL, version=version, variant="q8", **fields)
        )
