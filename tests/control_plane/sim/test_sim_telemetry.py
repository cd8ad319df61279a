"""Simulated devices report serving stats as agents do, with faults injected per slice."""

from __future__ import annotations

import asyncio
import datetime as dt
import math
import time

import pytest

from contract import errors
from control_plane.sim import FleetSimulator, SimOptions
from control_plane.sim.load import LLM_CONFIGS, SPREAD, Load, parse_injections
from control_plane.sim.profile import parse_profile
from control_plane.telemetry import Telemetry
from runtime.histogram import MAX_RELATIVE_ERROR, LatencyHistogram
from tests.control_plane.sim.conftest import MODEL
from tests.control_plane.sim.test_fleet import enrolled
from tests.control_plane.sim.test_sim_cli import rollout

FAST = SimOptions(devices_per_channel=8, sync_jitter_s=0.05)
SLOW_SOC, FAST_SOC = "sm8450", "sm8650"


def profile(**extra) -> dict:
    devices = [
        {"attributes": {"platform": "android", "soc": soc, "device_model": f"Phone {i}"}}
        for i, soc in enumerate([SLOW_SOC, FAST_SOC] * 4)
    ]
    return {"devices": devices, **extra}


@pytest.mark.parametrize(
    ("rules", "fragment"),
    [
        ("x", "'inject' must be a list"),
        ([{"model": f"{MODEL}:2"}], "inject[0] must be an object with 'select' and 'model'"),
        ([{"select": "soc=", "model": f"{MODEL}:2"}], "inject[0]: invalid selector at position"),
        ([{"select": "", "model": MODEL}], "inject[0].model must be NAME:VERSION"),
        ([{"select": "", "model": f"{MODEL}:2", "latency_x": 0}], "latency_x must be a number"),
        ([{"select": "", "model": f"{MODEL}:2", "crash_rate": 2}], "crash_rate must be a number"),
        ([{"select": "", "model": f"{MODEL}:2", "slow": 1}], "unknown key slow"),
        ([{"select": "", "model": f"{MODEL}:2", "decode_x": -1}], "decode_x must be a number"),
    ],
)
def test_a_bad_inject_rule_is_named(rules, fragment):
    with pytest.raises(errors.InvalidArgument) as caught:
        parse_profile(profile(inject=rules), source="p.json")
    assert fragment in str(caught.value) and str(caught.value).startswith("p.json: ")


def test_a_batch_is_what_an_agent_would_send():
    attrs = {"platform": "android", "soc": SLOW_SOC}
    (rule,) = parse_injections([{"select": f"soc={SLOW_SOC}", "model": "det:2", "latency_x": 3}])
    load = Load("dev_1", attrs, seed=0, requests_per_s=2000)
    end = dt.datetime.now(dt.UTC)
    batch = load.batch({"det": (2, "fp32")}, end - dt.timedelta(seconds=5), end, [rule])
    (stats,) = batch.models
    assert (stats.model, stats.version, stats.config) == ("det", 2, load.config)
    assert 9_000 < stats.inferences < 11_000
    h = LatencyHistogram.from_dict(
        {
            "scheme": stats.latency.scheme,
            "count": stats.latency.count,
            "sum_ns": stats.latency.sum_ns,
            "min_ns": stats.latency.min_ns,
            "max_ns": stats.latency.max_ns,
            "buckets": list(
                zip(stats.latency.bucket_index, stats.latency.bucket_count, strict=True)
            ),
        }
    )
    assert h.count == stats.inferences - stats.errors
    slowed = h.quantile(0.5)  # µs
    expected = load.median_us("det", 2, [rule])
    assert expected == pytest.approx(3 * load.median_us("det", 2, []))
    assert abs(math.log(slowed / expected)) < 2 * MAX_RELATIVE_ERROR + 0.03
    # Same device, same seed: the same latency; an idle device sends nothing.
    again = Load("dev_1", attrs, seed=0)
    assert again.median_us("det", 2, []) == load.median_us("det", 2, [])
    assert Load("dev_1", attrs, seed=0).batch({}, end - dt.timedelta(seconds=5), end, []) is None


def test_the_control_plane_sees_the_slowed_slice(cp_holder):
    cp = cp_holder["cp"]
    rules = [{"select": f"soc={SLOW_SOC}", "model": f"{MODEL}:2", "latency_x": 3.0}]

    async def scenario() -> dict:
        prof = parse_profile(profile(inject=rules))
        async with FleetSimulator([cp.address], profile=prof, options=FAST, tls=cp.tls) as sim:
            await enrolled(sim, cp, 8)
            await asyncio.to_thread(rollout, cp, 2, "", (100,), 0)
            await sim.wait_synced(MODEL, 2, installed=True, timeout=20)
            sim.report_all(0.5, requests_per_s=400)
            # Every device reports at least once (waited on, not a fixed sleep: a loaded
            # machine may take longer).
            deadline = time.monotonic() + 60
            while sim.stats().reports < 8:
                assert time.monotonic() < deadline, f"{sim.stats().reports} of 8 reports came"
                await asyncio.sleep(0.1)
            return {d.id: Load(d.id, d.identity.attributes, sim.seed) for d in sim.devices}, {
                d.id: d.identity.attributes["soc"] for d in sim.devices
            }

    loads, socs = asyncio.run(scenario())
    telemetry = Telemetry(cp.app.store)
    for device, load in loads.items():
        (row,) = [x for x in telemetry.latency(device) if x.version == 2]
        measured = row.histogram.quantile(0.5)  # µs
        base = load.median_us(MODEL, 2, [])
        factor = 3.0 if socs[device] == SLOW_SOC else 1.0
        # The median of n lognormal samples strays from the true one by a standard error
        # of sqrt(pi/2) * SPREAD / sqrt(n) in log space (a loaded machine reports fewer
        # samples, so the bound follows the count); allow four of those plus the
        # histogram's bucket error.
        n = row.histogram.count
        assert n >= 20, (device, n)
        bound = 4 * math.sqrt(math.pi / 2) * SPREAD / math.sqrt(n) + 2 * MAX_RELATIVE_ERROR
        off = abs(math.log(measured / (base * factor)))
        assert off < bound, (socs[device], measured, base, n, off, bound)


def _histogram(msg) -> LatencyHistogram:
    return LatencyHistogram.from_dict(
        {
            "scheme": msg.scheme,
            "count": msg.count,
            "sum_ns": msg.sum_ns,
            "min_ns": msg.min_ns,
            "max_ns": msg.max_ns,
            "buckets": list(zip(msg.bucket_index, msg.bucket_count, strict=True)),
        }
    )


def test_a_language_model_reports_generations_with_its_decode_slowed_where_injected():
    attrs = {"platform": "android", "soc": SLOW_SOC}
    (rule,) = parse_injections([{"select": f"soc={SLOW_SOC}", "model": "chat:2", "decode_x": 0.5}])
    end = dt.datetime.now(dt.UTC)
    period = (end - dt.timedelta(seconds=5), end)
    load = Load("dev_1", attrs, seed=0, requests_per_s=400)
    (stats,) = load.batch({"chat": (2, "q4")}, *period, [rule], {"chat"}).models
    assert stats.config == load.llm_config in LLM_CONFIGS and 1_700 < stats.inferences < 2_300
    ok = stats.inferences - stats.errors
    assert stats.ttft.count == ok and 0 < stats.cancellations < 0.05 * ok
    assert stats.tokens_out > 50 * ok and stats.tokens_in > 40 * ok
    decode = _histogram(stats.latency)  # time per token
    tps = 1e6 / decode.quantile(0.5)
    assert tps == pytest.approx(load.decode_tps("chat", 2, [rule]), rel=0.05)
    assert load.decode_tps("chat", 2, [rule]) == pytest.approx(0.5 * load.decode_tps("chat", 2, []))
    # TTFT: the prompt's prefill at PREFILL_X times the decode speed, and one token.
    assert _histogram(stats.ttft).quantile(0.5) > decode.quantile(0.5)
    # The same device on another version, or a tensor model, is untouched.
    (other,) = load.batch({"chat": (1, "q4")}, *period, [rule], {"chat"}).models
    assert 1e6 / _histogram(other.latency).quantile(0.5) == pytest.approx(
        load.decode_tps("chat", 1, []), rel=0.05
    )
    (tensor,) = load.batch({"det": (2, "fp32")}, *period, [rule]).models
    assert not tensor.HasField("ttft") and tensor.tokens_out == 0


def test_a_profile_of_faults_alone_applies_them_to_the_default_fleet(tmp_path):
    """The profile exactly as operators write it: no fleet of its own, a slice slowed by
    SoC and another crashing by a device-model glob, on one version only."""
    from control_plane.sim.profile import load_profile

    path = tmp_path / "faults.json"
    path.write_text(
        '{"inject": [{"select": "soc=sm8450", "model": "ctr:2", "latency_x": 3.0},'
        ' {"select": "device_model~Moto*", "model": "ctr:2", "crash_rate": 0.01}]}'
    )
    prof = load_profile(path)
    default = load_profile()
    fleet = [prof.attributes(7, i) for i in range(400)]
    assert fleet == [default.attributes(7, i) for i in range(400)]
    slow = [a for a in fleet if a["soc"] == "sm8450"]
    moto = [a for a in fleet if a["device_model"].startswith("Moto")]
    plain = [a for a in fleet if a["soc"] not in ("sm8450",) and a["platform"] == "android"]
    assert slow and moto and plain  # the default fleet has both slices, and others
    end = dt.datetime.now(dt.UTC)

    def crashes(attrs: dict, version: int) -> tuple[int, int]:
        """Crashes and inferences over 20 one-minute batches at 10 requests a second."""
        load, crashed, runs = Load("dev_x", attrs, seed=1, requests_per_s=10), 0, 0
        for _ in range(20):
            period = (end - dt.timedelta(seconds=60), end)
            (s,) = load.batch({"ctr": (version, "fp32")}, *period, prof.injections).models
            crashed, runs = crashed + len(s.crashes), runs + s.inferences
        return crashed, runs

    for attrs in slow[:3]:
        load = Load("dev_s", attrs, seed=1)
        assert load.median_us("ctr", 2, prof.injections) == pytest.approx(
            3 * load.median_us("ctr", 2, [])
        )
        assert load.median_us("ctr", 1, prof.injections) == load.median_us("ctr", 1, [])
    crashed, runs = crashes(moto[0], 2)
    assert 0.007 < crashed / runs < 0.013  # 1% of about 12,000 inferences
    assert crashes(moto[0], 1)[0] < 0.001 * crashes(moto[0], 1)[1]  # v1 runs clean
    assert crashes(plain[0], 2)[0] < 0.001 * crashes(plain[0], 2)[1]
