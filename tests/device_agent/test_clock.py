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

from contract.assignment import AssignmentRejected, canonical_json, new_nonce, verify_sync
from contract.pinned_keys import PinnedKeyRing
from contract.server_clock import ServerClock, describe_offset, skew_notice
from device_agent.report_outbox import Collector, Outbox
from device_agent.state import StateDir
from protos import device_pb2
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


def _document(key, *, nonce: bytes, issued: dt.datetime, ttl: dt.timedelta, revision=1):
    body = canonical_json(
        {
            "schema": "skiff.assignment/v1",
            "device": "dev_1",
            "nonce": nonce.hex(),
            "revision": revision,
            "issued_at": issued.isoformat(),
            "expires_at": (issued + ttl).isoformat(),
            "models": {},
        }
    )
    return device_pb2.SyncResponse(
        revision=revision, document=body, document_signature=key.sign(body)
    )


def test_expiry_is_judged_on_the_answers_signed_time_and_replays_still_fail():
    key = Ed25519PrivateKey.generate()
    nonce = new_nonce()
    # Signed a day and more before the device's clock reads: accepted, on the server's time.
    issued = dt.datetime.now(dt.UTC) - dt.timedelta(hours=26)
    answer = _document(key, nonce=nonce, issued=issued, ttl=dt.timedelta(hours=24))
    check = dict(device_id="dev_1", keys=[key.public_key()], last_revision=0)
    verified = verify_sync(answer, nonce=nonce, round_trip_s=0.2, **check)
    assert verified.issued_at == issued
    # Judged on the device's own (wrong) clock, it would have been refused as expired.
    with pytest.raises(AssignmentRejected, match="expired"):
        verify_sync(answer, nonce=nonce, now=dt.datetime.now(dt.UTC), **check)
    # The same answer replayed to another request, or below the revision held: refused.
    with pytest.raises(AssignmentRejected, match="nonce differs"):
        verify_sync(answer, nonce=new_nonce(), round_trip_s=0.2, **check)
    with pytest.raises(AssignmentRejected, match="older"):
        verify_sync(answer, nonce=nonce, round_trip_s=0.2, **{**check, "last_revision": 2})
    # A trip longer than the answer's life: expired on the control plane's own time.
    short = _document(key, nonce=nonce, issued=issued, ttl=dt.timedelta(seconds=5))
    with pytest.raises(AssignmentRejected, match="expired .*control plane time"):
        verify_sync(short, nonce=nonce, round_trip_s=6, **check)


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


def test_the_skew_is_said_once_and_when_it_goes():
    said, line = skew_notice(None, 120.0)
    assert (said, line) == (None, None)
    said, line = skew_notice(None, -DAY_AND_TWO)
    assert line == describe_offset(-DAY_AND_TWO) and said == -DAY_AND_TWO
    assert skew_notice(said, -DAY_AND_TWO + 3) == (said, None)
    said, line = skew_notice(said, 2.0)
    assert said is None and line.startswith("device clock back in step")
    assert describe_offset(400) == (
        "device clock is 6.7 min ahead of the control plane; using the control plane's time"
    )
