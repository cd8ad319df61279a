"""The attack review's reproductions, end to end: a hostile device with a real enrollment
talks gRPC directly while a simulated fleet reports honestly (SQLite and PostgreSQL).

It can neither halt a healthy rollout nor hide a real regression: reports of a version
it was not assigned land outside the cohorts (counted, never judged), and as a candidate
its figures are capped and left out."""

from __future__ import annotations

import asyncio
import datetime as dt

import numpy as np

from contract.report_batches import histogram_pb, new_batch_id, timestamp
from control_plane.rollouts.lifecycle import bucket, stage_limit
from protos import device_pb2
from runtime.histogram import LatencyHistogram
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.sim.conftest import MODEL, wait_for
from tests.control_plane.sim.test_guardrails import create, fleet_on_v1, guarded, show

__all__ = ["guarded"]  # the fixture, shared with the guardrail scenarios

CONFIG = "CPU/normal/t4/mem-normal"  # what the simulated phones without a GPU run


def liars(cp, n: int = 16) -> list[Device]:
    """Devices enrolled with the fleet's public token, before the fleet starts."""
    with cp.client() as client:
        token = client.create_enrollment_token().token
    attrs = {"platform": "android", "soc": "sm8450", "device_model": "Phone 0"}
    return [Device.enroll(cp.address, token, attrs) for _ in range(n)]


def pick(devices: list[Device], rollout, *, in_stage: bool) -> Device:
    limit = stage_limit(list(rollout.stages), rollout.stage - 1)  # the message counts from 1
    return next(d for d in devices if (bucket(rollout.id, d.id) < limit) == in_stage)


def budget(cp, device: Device, most: int) -> int:
    """Return how many inferences the server credits the device with so far (at most `most`)."""
    enrolled = cp.app.fleet.get(device.id).enrolled_at
    return min(most, int((dt.datetime.now(dt.UTC) - enrolled).total_seconds() * 100_000))


def lie(cp, device: Device, version: int, value_ns: float, most: int) -> None:
    """Report as many samples of `value_ns` of MODEL:version as the server will credit
    (up to `most`), over all the time the device has had since it enrolled."""
    n = budget(cp, device, most)
    h = LatencyHistogram()
    h.record_many_ns(np.full(n, value_ns))
    enrolled = cp.app.fleet.get(device.id).enrolled_at
    stats = device_pb2.ModelStats(
        model=MODEL,
        version=version,
        variant="fp32",
        config=CONFIG,
        inferences=n,
        latency=histogram_pb(h),
    )
    device.report(
        device_pb2.ReportRequest(
            batch_id=new_batch_id(),
            period_start=timestamp(enrolled),
            period_end=timestamp(dt.datetime.now(dt.UTC)),
            models=[stats],
        )
    )


def test_one_device_cannot_halt_a_healthy_rollout(guarded):
    """Reproduction 1: a device assigned v1 (not in the stage) reports v2 with 100,000
    samples at 5 s; another, in the stage, does the same as a candidate."""
    cp = guarded
    hostile = liars(cp)

    async def scenario() -> dict:
        async with fleet_on_v1(cp, []):
            r = await asyncio.to_thread(
                create,
                cp,
                2,
                stages=[50, 100],
                bake_s=2,
                halt=["p95_latency_ratio>1.5"],
                min_devices=3,
                min_inferences=300,
            )
            outsider = pick(hostile, r, in_stage=False)
            candidate = pick(hostile, r, in_stage=True)
            await asyncio.to_thread(lie, cp, outsider, 2, 5e9, 100_000)
            await asyncio.to_thread(lie, cp, candidate, 2, 5e9, 100_000)

            def done():
                doc = show(cp, r.id)
                return doc if doc["state"] in ("completed", "paused") else None

            return await asyncio.to_thread(wait_for, done, 120, "the rollout to finish")

    doc = asyncio.run(scenario())
    assert doc["state"] == "completed", [e for e in doc["audit"] if e["action"] == "pause"]
    assert "pause" not in [e["action"] for e in doc["audit"]]
    assert doc["health"]["outside"]["reports"] >= 1 and doc["health"]["outside"]["devices"] >= 1


def test_one_device_cannot_hide_a_real_regression(guarded):
    """Reproduction 2: v2 crashes 5% of the time and runs 3x slower on every device; one
    candidate sends a million fast, crash-free inferences (all its budget allows)."""
    cp = guarded
    hostile = liars(cp)
    inject = [{"select": "", "model": f"{MODEL}:2", "crash_rate": 0.05, "latency_x": 3.0}]

    async def scenario() -> dict:
        async with fleet_on_v1(cp, inject):
            r = await asyncio.to_thread(
                create,
                cp,
                2,
                stages=[50, 100],
                bake_s=60,
                halt=["crash_rate>0.01", "p95_latency_ratio>1.5"],
                min_devices=3,
                min_inferences=300,
            )
            liar = pick(hostile, r, in_stage=True)
            await asyncio.to_thread(lie, cp, liar, 2, 50_000.0, 1_000_000)

            def judged_with_the_liar():
                rows = cp.app.store.device_rollups(r.id)
                if not any(
                    x.key.device_id == liar.id and x.key.cohort == "candidate" for x in rows
                ):
                    return None  # not rolled up yet
                health = cp.app.guard.health(cp.app.rollouts.get(r.id))
                failing = [v for v in health.overall.verdicts if v.status == "fail"]
                return failing or None

            failing = await asyncio.to_thread(
                wait_for, judged_with_the_liar, 90, "a failing verdict with the liar's report in"
            )

            def paused():
                doc = show(cp, r.id)
                return doc if doc["state"] == "paused" else None

            doc = await asyncio.to_thread(wait_for, paused, 90, "a guardrail pause")
            return doc, failing, liar.id

    doc, failing, _ = asyncio.run(scenario())
    pause = [e for e in doc["audit"] if e["action"] == "pause"][-1]
    assert pause["actor"] == "guardrail" and pause["evidence"]["failed"]
    # The rules broke with the liar's million fast, crash-free inferences in the candidate
    # cohort (capped at four devices' worth, and left out where it pulled hardest).
    assert {v.rule for v in failing} <= {"crash_rate>0.01", "p95_latency_ratio>1.5"}
    for verdict in failing:
        assert verdict.sample["candidate_devices"] >= 3, verdict
