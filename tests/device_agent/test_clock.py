"""A device clock a day off: the agent installs on the control plane's time and says so."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import subprocess
import time

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from contract.assignment import AssignmentRejected
from contract.pinned_keys import PinnedKeyRing
from contract.server_clock import ServerClock
from device_agent.report_outbox import Collector, Outbox
from device_agent.state import StateDir
from runtime.backends import BackendConfig
from runtime.events import CrashEvent
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_agent import SKIFF, agent, rollout, status, token
from tests.device_agent.test_serving import fleet_show

DAY_AND_TWO = 26 * 3600.0


def rollout_counts(cp, rollout_id: str):
    cp.app.writer.flush()  # device reports are written behind: make them visible now
    with cp.client() as client:
        return client.get_rollout(rollout_id).counts


@pytest.mark.parametrize("skew", [DAY_AND_TWO, -DAY_AND_TWO], ids=["ahead", "behind"])
def test_a_clock_a_day_off_installs_and_names_the_skew(cp, tmp_path, caplog, skew):
    caplog.set_level(logging.INFO, logger="skiff.agent")
    created = rollout(cp, 1)
    state = tmp_path / "s"

    async def main():
        clock = lambda: time.time() + skew  # noqa: E731 - the device's wall clock
        async with agent(cp, state, enroll_token=token(cp), clock=clock) as a:
            first = await a.sync_once()
            again = await a.sync_once()  # said once, not at every answer
            queued = a.outbox.pending()
            assert await a.flush_reports() == len(queued) == 1
            return first, again, queued[0], a.server_clock.offset_s, a.identity.device_id

    first, again, batch, offset, device = asyncio.run(main())
    assert first.converged and again.converged
    assert [(o.model, o.version, o.result) for o in first.installs] == [(MODEL, 1, "activated")]
    assert offset == pytest.approx(skew, abs=5)
    side = "ahead of" if skew > 0 else "behind"
    said = f"device clock is 26.0 h {side} the control plane; using the control plane's time"
    assert [r.getMessage() for r in caplog.records if "device clock" in r.getMessage()] == [said]
    assert not [r for r in caplog.records if "expired" in r.getMessage()]
    # Its telemetry is on the control plane's time and carries the offset.
    now = dt.datetime.now(dt.UTC)
    assert batch.clock_offset_s == pytest.approx(skew, abs=5)
    (install,) = batch.installs
    assert abs(install.at.ToDatetime(dt.UTC) - now) < dt.timedelta(minutes=5)
    assert abs(batch.period_end.ToDatetime(dt.UTC) - now) < dt.timedelta(minutes=5)
    (shown,) = fleet_show(cp, device)["recent_installs"]
    assert abs(dt.datetime.fromisoformat(shown["at"]) - now) < dt.timedelta(minutes=5)
    # `agent status`, as JSON and as text, names the skew.
    body = status(state)
    assert body["clock_offset_s"] == pytest.approx(skew, abs=5) and body["clock"] == said
    text = subprocess.run(
        [*SKIFF, "agent", "status", "--state", str(state)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"clock    {said}" in text
    # It accepted the answer and said so: counted synced (and installed) once.
    counts = rollout_counts(cp, created.id)
    assert (counts.synced, counts.installed) == (1, 1)


def test_an_answer_refused_is_not_counted_synced(cp, tmp_path):
    """An agent pinning another key refuses every answer: the control plane never counts
    it synced (it used to count every device it answered)."""
    created = rollout(cp, 1)
    state = tmp_path / "s"

    async def enroll():
        async with agent(cp, state, enroll_token=token(cp)):
            pass

    asyncio.run(enroll())
    dir_ = StateDir(state)
    identity = dir_.load_identity()
    stranger = Ed25519PrivateKey.generate().public_key()
    pem = stranger.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    dir_.save_identity(
        type(identity)(**{**identity.__dict__, "pinned": PinnedKeyRing.from_pems([pem])})
    )

    async def refused():
        async with agent(cp, state) as a:
            with pytest.raises(AssignmentRejected, match="signature"):
                await a.sync_once()

    asyncio.run(refused())
    assert rollout_counts(cp, created.id).synced == 0


def test_periods_are_back_to_back_on_the_control_plane_time(tmp_path):
    wall, mono = [2_000_000_000.0 + DAY_AND_TWO], [100.0]
    clock = ServerClock(lambda: wall[0], lambda: mono[0])

    def tick(seconds: float) -> None:
        wall[0] += seconds
        mono[0] += seconds

    collector = Collector(clock)  # the agent starts: its first period starts now
    tick(10)
    # The first answer: the control plane read 2e9 + 10 then (the device is a day ahead).
    clock.measure(2_000_000_010.0, sent=mono[0] - 0.3, received=mono[0])
    assert clock.offset_s == pytest.approx(DAY_AND_TWO)
    key = (MODEL, 1, "fp32", "CPU/normal/t1/mem-normal")
    collector.inference(key, 250_000, True)
    crashed_at = time.time() - 2.0  # the runtime stamps its events on its own wall clock
    config = BackendConfig.from_key(key[3])
    collector.events(key, [CrashEvent(config, "signal", "SIGSEGV", time=crashed_at)], [])
    tick(60)
    first = collector.cut()
    assert first.period_start.ToSeconds() == 2_000_000_000  # when the agent started
    assert first.period_end.ToSeconds() == 2_000_000_070
    assert first.clock_offset_s == pytest.approx(DAY_AND_TWO)
    (crash,) = first.models[0].crashes
    assert crash.at.ToNanoseconds() / 1e9 == pytest.approx(2_000_000_068.0, abs=0.5)
    tick(30)
    assert collector.cut() is None  # nothing to say: the period goes on
    collector.inference(key, 250_000, True)
    tick(30)
    # Measured again, 80 s earlier than the clock had it: still no overlap.
    clock.measure(2_000_000_050.0, sent=mono[0], received=mono[0])
    second = collector.cut()
    assert second.period_start == first.period_end
    assert second.period_end == second.period_start  # never before its start
    tick(25)
    collector.inference(key, 250_000, True)
    third = collector.cut()
    assert third.period_start == second.period_end
    assert third.period_end.ToSeconds() == 2_000_000_075
    # A new run starts no earlier than the last period the outbox queued.
    box = Outbox(tmp_path / "q.db")
    box.put(third)
    after = Collector(ServerClock(lambda: 2_000_000_050.0, lambda: 0.0))
    after.resume_after(box.period_end)
    after.inference(key, 250_000, True)
    assert after.cut().period_start == third.period_end
    box.close()
