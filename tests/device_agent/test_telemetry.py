"""Telemetry: the Report RPC refuses what does not fit, and the agent's queue survives outages."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from contract.device_client import BACKOFF_CAP_S, DeviceCallError, DeviceConnection
from device_agent.report_outbox import Outbox, install_batch, new_batch_id, timestamp
from protos import device_pb2
from runtime.histogram import LatencyHistogram
from tests.control_plane.sim.conftest import restart
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_agent import agent, rollout, run_agent_cli, token
from tests.device_agent.test_serving import fleet_show, infer


def report(**kw) -> device_pb2.ReportRequest:
    now = time.time()
    h = LatencyHistogram()
    h.record_ns(250_000)
    stats = device_pb2.ModelStats(
        model=MODEL, version=1, variant="fp32", config="CPU/normal/t1/mem-normal", inferences=1
    )
    body = h.to_dict()
    stats.latency.scheme, stats.latency.count, stats.latency.sum_ns = (
        body["scheme"],
        body["count"],
        body["sum_ns"],
    )
    stats.latency.min_ns, stats.latency.max_ns = body["min_ns"], body["max_ns"]
    stats.latency.bucket_index.extend(i for i, _ in body["buckets"])
    stats.latency.bucket_count.extend(n for _, n in body["buckets"])
    msg = device_pb2.ReportRequest(
        batch_id=new_batch_id(),
        period_start=timestamp(now - 60),
        period_end=timestamp(now),
        models=[stats],
    )
    for key, value in kw.items():
        setattr(msg, key, value) if not callable(value) else value(msg)
    return msg


def test_report_refuses_what_does_not_fit_and_applies_a_batch_once(cp, tmp_path):
    async def main():
        async with agent(cp, tmp_path / "s", enroll_token=token(cp)) as a:
            conn: DeviceConnection = a._conn
            good = report()
            assert (await conn.report(good)).duplicate is False
            assert (await conn.report(good)).duplicate is True

            def bad_scheme(m):
                m.models[0].latency.scheme = "linear"

            def uneven(m):
                m.models[0].latency.bucket_count.append(1)

            def miscounted(m):
                m.models[0].latency.count = 7

            def future(m):
                m.period_end.FromSeconds(int(time.time()) + 86400 * 30)

            def bad_result(m):
                m.installs.append(
                    device_pb2.InstallReport(
                        at=timestamp(time.time()),
                        model=MODEL,
                        version=1,
                        variant="fp32",
                        result="exploded",
                    )
                )

            def nul(m):
                m.installs.append(
                    device_pb2.InstallReport(
                        at=timestamp(time.time()),
                        model=MODEL,
                        version=1,
                        variant="fp32",
                        result="failed",
                        reason="a\x00b",
                    )
                )

            def negative(m):
                m.installs.append(
                    device_pb2.InstallReport(
                        at=timestamp(time.time()),
                        model=MODEL,
                        version=1,
                        variant="fp32",
                        result="activated",
                        download_s=float("nan"),
                    )
                )

            def many(m):
                m.models.extend([m.models[0]] * 300)

            def huge_histogram(m):  # refused before any list is built from it
                m.models[0].latency.bucket_index.extend([0] * 1_000_000)
                m.models[0].latency.bucket_count.extend([0] * 1_000_000)

            def inverted(m):
                m.models[0].latency.min_ns = m.models[0].latency.max_ns + 1

            def ancient(m):
                m.period_start.FromSeconds(86400)

            def negative_bucket(m):  # the total still adds up: -1 + 1 + ... = count
                h = m.models[0].latency
                h.bucket_index.extend([0, 1])
                h.bucket_count.extend([-1, 1])

            def over_the_rate(m):  # after the accepted period: judged on the rate alone
                m.period_start.CopyFrom(good.period_end)
                m.models[0].inferences = 10**12

            def negative_count(m):
                h = m.models[0].latency
                del h.bucket_index[:], h.bucket_count[:]
                h.count = -1

            cases = {
                "must be 8 to 64": lambda m: setattr(m, "batch_id", "x"),
                "is not 'log2": bad_scheme,
                "differ in length": uneven,
                "do not add up": miscounted,
                "is in the future": future,
                "is not one of activated": bad_result,
                "control character": nul,
                "finite number": negative,
                "at most 256": many,
                "more than 218 buckets": huge_histogram,
                "min_ns is above max_ns": inverted,
                "do not fall in its lowest and highest": lambda m: setattr(
                    m.models[0].latency, "max_ns", 2**62
                ),
                "more than 30 days old": ancient,
                "invalid model name": lambda m: setattr(m.models[0], "model", "../x"),
                "more than 100000 a second": over_the_rate,
                "more errors or timed samples": lambda m: setattr(m.models[0], "errors", 10**6),
                "is not a backend config key": lambda m: setattr(m.models[0], "config", "GPU!"),
                "inferences must be between 0": lambda m: setattr(m.models[0], "inferences", -5),
                "errors must be between 0": lambda m: setattr(m.models[0], "errors", -1),
                "pipeline_firings must be between 0": lambda m: setattr(
                    m.models[0], "pipeline_firings", -3
                ),
                "bad histogram bucket": negative_bucket,
                "latency count must be between 0": negative_count,
                "tokens_out 1099511627776 for": lambda m: setattr(m.models[0], "tokens_out", 2**40),
                "tokens_in must be between 0": lambda m: setattr(m.models[0], "tokens_in", -1),
                "more first tokens timed or generations cancelled": lambda m: setattr(
                    m.models[0], "cancellations", 10**6
                ),
                "ttft: histogram scheme": lambda m: m.models[0].ttft.SetInParent(),
                "dropped_batches must be between 0": lambda m: setattr(m, "dropped_batches", -1),
            }
            for expected, mutate in cases.items():
                msg = report()
                mutate(msg)
                with pytest.raises(DeviceCallError) as info:
                    await conn.report(msg)
                assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, expected
                assert expected in info.value.message, (expected, info.value.message)
            anonymous = DeviceConnection(a._channel, "")
            with pytest.raises(DeviceCallError) as info:
                await anonymous.report(report())
            assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
            return a.identity.device_id, len(cases)

    device, refused = asyncio.run(main())
    cp.app.telemetry.writer.flush()
    shown = fleet_show(cp, device)
    assert [x["inferences"] for x in shown["latency"]] == [1]  # the good batch, once
    # Every refusal is counted on the device, with the latest reason.
    assert shown["reports_refused"] == refused
    assert "dropped_batches must be between 0" in shown["last_refusal"]


def test_the_outbox_is_bounded_drops_oldest_first_and_counts_them(tmp_path):
    path = tmp_path / "telemetry.db"
    box = Outbox(path, max_bytes=2000, max_age_s=3600)
    sent = []
    for i in range(10):
        b = install_batch([device_pb2.InstallReport(model=MODEL, version=i + 1, reason="x" * 300)])
        box.put(b, now=1000.0 + i)
        sent.append(b.batch_id)
    kept = [b.batch_id for b in box.pending()]
    assert kept == sent[-len(kept) :] and 3 <= len(kept) < 10
    assert box.pending()[0].dropped_batches == 10 - len(kept) == box.dropped
    box.close()
    box = Outbox(path, max_bytes=2000, max_age_s=3600)  # survives a restart
    assert [b.batch_id for b in box.pending()] == kept
    first = box.pending()[0]
    box.ack(first)
    assert box.dropped == 0 and len(box) == len(kept) - 1
    # Too old: dropped at the next put, and counted.
    box.put(install_batch([]), now=1000.0 + 7200)
    assert len(box) == 1 and box.dropped == len(kept) - 1
    assert oct(path.stat().st_mode & 0o777) == "0o600"


def test_a_damaged_queue_file_is_set_aside_and_the_agent_goes_on(cp, tmp_path):
    state = tmp_path / "s"
    rollout(cp, 1)
    first = run_agent_cli(cp, state, "--enroll-token", token(cp))
    assert first.returncode == 0, first.stderr
    for suffix in ("", "-wal", "-shm"):
        (state / f"telemetry.db{suffix}").unlink(missing_ok=True)
    (state / "telemetry.db").write_bytes(b"this is not sqlite" * 100)
    done = run_agent_cli(cp, state)
    assert done.returncode == 0, done.stderr
    assert "damaged" in done.stderr
    (aside,) = state.glob("telemetry.db.damaged-*")
    assert aside.read_bytes().startswith(b"this is not sqlite")


def test_reports_wait_out_a_control_plane_outage_then_land_once(cp, tmp_path):
    """The control plane goes away: the agent keeps serving and queueing, then catches up."""
    state = tmp_path / "s"
    holder = {"cp": cp}
    rollout(cp, 1)

    async def main():
        async with agent(cp, state, enroll_token=token(cp), serve=True, report_interval_s=0.5) as a:
            stop = asyncio.Event()
            runner = asyncio.create_task(a.run(stop))
            try:
                while (a.serving.serving(MODEL) or {}).get("version") != 1:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(1.5)  # the install report goes out
                holder["cp"].stop()
                for _ in range(20):
                    assert (await asyncio.to_thread(infer, state)).version == 1
                # Until the agent knows the control plane is gone and queues its reports
                # (its Watch reconnects back off meanwhile), serving all along.
                deadline = time.monotonic() + 60
                while not (len(a.outbox) >= 1 and not a.reachable):
                    assert time.monotonic() < deadline, "the agent never queued a report"
                    await asyncio.sleep(0.1)
                assert (await asyncio.to_thread(infer, state)).version == 1
                holder["cp"] = await asyncio.to_thread(restart, holder["cp"])
                deadline = time.monotonic() + 60
                while len(a.outbox):
                    assert time.monotonic() < deadline, "the queue never drained"
                    await asyncio.sleep(0.2)
                # And it follows what changed while it was away, within the backoff cap.
                await asyncio.to_thread(rollout, holder["cp"], 2)
                deadline = time.monotonic() + BACKOFF_CAP_S + 15
                while (a.serving.serving(MODEL) or {}).get("version") != 2:
                    assert time.monotonic() < deadline, "never caught up with v2"
                    await asyncio.sleep(0.2)
            finally:
                stop.set()
                await runner
            return a.identity.device_id

    try:
        device = asyncio.run(main())
        shown = fleet_show(holder["cp"], device)
    finally:
        if holder["cp"] is not cp:
            holder["cp"].stop()
    assert sum(x["inferences"] for x in shown["latency"]) == 21
    assert [(i["version"], i["result"]) for i in shown["recent_installs"]] == [
        (2, "activated"),
        (1, "activated"),
    ]


def test_the_report_loop_stops_when_cancelled_as_it_wakes(tmp_path):
    """A cancel that lands as an install report wakes the loop must still stop it.

    (asyncio.wait_for on Python 3.11 can swallow such a cancel; the agent's stop then
    waited for the report loop for ever.)
    """
    from device_agent.report_outbox import Collector
    from device_agent.reporting import Reporter

    async def send(batch):
        return None

    async def scenario() -> None:
        outbox = Outbox(tmp_path / "q.db")
        reporter = Reporter(outbox, Collector(), send, interval_s=60)
        for _ in range(50):
            task = asyncio.create_task(reporter.loop())
            await asyncio.sleep(0)
            reporter._now.set()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=2)
            assert done, "the report loop outlived its cancel"
        outbox.close()

    asyncio.run(scenario())
