"""Promoting a new version of a model the device serves: it serves after one golden check.

The new version starts on the config its predecessor won with; the other candidates are
probed while it serves, and a faster one takes over. A version failing its golden check
never serves, whichever way it is tried.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json

import numpy as np

import runtime
import runtime.probe
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_agent import agent, rollout, token

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


def _pointer(state) -> dict:
    return json.loads((state / "models" / f"{MODEL}.json").read_text())


async def _probed(state, timeout: float = 120) -> dict:
    """Wait for the probe after a promote to be recorded; return the active slot."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while (active := _pointer(state)["active"]).get("probes_pending"):
        assert loop.time() < deadline, "the probe after the promote never ended"
        await asyncio.sleep(0.05)
    return active


def _slowed(monkeypatch, slow_key: str) -> None:
    """Make every timing of `slow_key` read ten times slower (as on a busy backend)."""
    real = runtime.probe._measure

    def measure(executor, *args, **kwargs):
        result = real(executor, *args, **kwargs)
        if executor.config.key != slow_key or result.p50_us is None:
            return result
        return dataclasses.replace(result, p50_us=result.p50_us * 10)

    monkeypatch.setattr(runtime.probe, "_measure", measure)


def test_a_new_version_serves_on_the_previous_pick_then_probes_the_rest(cp, tmp_path):
    state = tmp_path / "s"

    async def scenario():
        async with agent(cp, state, enroll_token=token(cp), serve=True) as a:
            rollout(cp, 1)
            await a.sync_once()
            v1 = _pointer(state)["active"]
            assert len(v1["probes"]) > 1 and "probes_pending" not in v1  # a first install probes

            rollout(cp, 2)
            outcome = await a.sync_once()
            (done,) = outcome.installs
            assert done.result == "activated" and done.probes_pending
            v2 = _pointer(state)["active"]
            # It serves after one load and golden check on v1's config, nothing probed yet.
            assert v2["version"] == 2 and v2["config"] == v1["config"] and v2["probes_pending"]
            ((tried),) = v2["probes"]
            assert tried["config"] == v1["config"] and tried["accepted"]
            info, config, outputs, _ = a.serving.infer(MODEL, {"x": X})
            assert info["version"] == 2 and config == v1["config"]

            probed = await _probed(state)
            keys = [p["config"] for p in probed["probes"]]
            assert keys[0] == v1["config"] and len(keys) == len(v1["probes"])
            assert sorted(keys) == sorted(p["config"] for p in v1["probes"])
            info, config, again, _ = a.serving.infer(MODEL, {"x": X})
            assert info["version"] == 2 and config == probed["config"]
            np.testing.assert_allclose(again["y"], outputs["y"], rtol=1e-4, atol=1e-5)
            assert a.installer.pointer(MODEL)["previous"]["version"] == 1

    asyncio.run(scenario())


def test_a_faster_config_found_while_serving_takes_over_and_is_recorded(cp, tmp_path, monkeypatch):
    state = tmp_path / "s"

    async def scenario():
        async with agent(cp, state, enroll_token=token(cp), serve=True) as a:
            rollout(cp, 1)
            await a.sync_once()
            first = _pointer(state)["active"]["config"]
            _slowed(monkeypatch, first)  # from now on v1's pick is the slow one here
            rollout(cp, 2)
            await a.sync_once()
            assert _pointer(state)["active"]["config"] == first  # served on it at first
            probed = await _probed(state)
            assert probed["config"] != first
            (own,) = [p for p in probed["probes"] if p["config"] == first]
            assert own["accepted"]  # slower, not wrong: it stays as a fallback
            _, config, _, _ = a.serving.infer(MODEL, {"x": X})
            assert config == probed["config"]

    asyncio.run(scenario())


def test_a_new_version_failing_its_golden_check_never_serves(cp, tmp_path, monkeypatch):
    state = tmp_path / "s"
    real = runtime.Golden.from_npz

    def wrong_outputs(data: bytes) -> runtime.Golden:
        golden = real(data)
        negated = {name: -(out + 1) for name, out in golden.outputs.items()}
        return dataclasses.replace(golden, outputs=negated)

    async def scenario():
        async with agent(cp, state, enroll_token=token(cp), serve=True) as a:
            rollout(cp, 1)
            await a.sync_once()
            monkeypatch.setattr(runtime.Golden, "from_npz", staticmethod(wrong_outputs))
            rollout(cp, 2)
            outcome = await a.sync_once()
            (done,) = outcome.installs
            assert done.result == "failed" and "self-test failed" in done.reason
            assert not done.probes_pending
            pointer = _pointer(state)
            assert pointer["active"]["version"] == 1 and pointer["failed"]["version"] == 2
            info, _, _, _ = a.serving.infer(MODEL, {"x": X})
            assert info["version"] == 1  # the previous version serves on

    asyncio.run(scenario())
