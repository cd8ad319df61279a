"""Simulated devices keep their reports through an outage, as agents do, and deliver every
period's figures once, in order, when the control plane is back."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt

import grpc
import pytest
from sqlalchemy import text

from contract.device_client import DeviceCallError, backoff_s
from contract.report_batches import new_batch_id
from control_plane.sim import FleetSimulator, SimOptions
from control_plane.sim.load import Load
from control_plane.sim.outbox import ReportQueue
from protos import device_pb2
from tests.conftest import _pg_admin_engine
from tests.control_plane.sim.conftest import MODEL, copy_home, serve
from tests.control_plane.sim.test_fleet import enrolled
from tests.control_plane.sim.test_sim_cli import rollout

FAST = SimOptions(devices_per_channel=8, sync_jitter_s=0.05)
N = 3
RATE = 5_000  # inferences a second: a period of MIN_PERIOD_S holds some
MIN_PERIOD_S = 0.005
ROUNDS_DOWN = 3
EPOCH = dt.datetime(2000, 1, 1, tzinfo=dt.UTC)


class Recorded(Load):
    """The simulator's own load, remembering each period it was asked for and its batch."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.periods: list[tuple[dt.datetime, dt.datetime, device_pb2.ReportRequest | None]] = []

    def batch(self, installed, start, end, injections, llm=frozenset()):
        made = super().batch(installed, start, end, injections, llm)
        self.periods.append((start, end, made))
        return made


class Wire:
    """A spy on one device's Report calls (the real call goes through), able to lose the
    reply to one batch after the control plane applied it."""

    def __init__(self, device) -> None:
        self.sent: list[device_pb2.ReportRequest] = []  # copies, in the order sent
        self.answered: list[tuple[str, bool]] = []  # (batch id, duplicate), in order
        self.lose_reply_to = ""
        self._report = device._conn.report
        device._conn.report = self

    async def __call__(self, batch: device_pb2.ReportRequest):
        copy = device_pb2.ReportRequest()
        copy.CopyFrom(batch)
        self.sent.append(copy)
        reply = await self._report(batch)
        self.answered.append((batch.batch_id, reply.duplicate))
        if batch.batch_id == self.lose_reply_to:
            self.lose_reply_to = ""
            raise DeviceCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "the reply was lost")
        return reply


async def one_period(device, load: Load) -> device_pb2.ReportRequest:
    """Cut the device's next period once it is MIN_PERIOD_S long (the control plane credits
    a period with no more inferences a second than any device could run)."""
    device.start_reporting()
    while True:
        left = device._period_start + MIN_PERIOD_S - device.clock.now()
        if left > 0:
            await asyncio.sleep(left)
        elif (batch := device.cut_report(load, ())) is not None:
            return batch


async def drain(sim: FleetSimulator, timeout: float = 60.0) -> None:
    """Flush every queue until empty, retrying with the devices' own backoff."""
    loop = asyncio.get_running_loop()
    deadline, attempt = loop.time() + timeout, 0
    while any(len(d.outbox) for d in sim.devices):
        assert loop.time() < deadline, "the queues never drained"
        for device in sim.devices:
            await device.flush_reports()
        await asyncio.sleep(backoff_s(attempt))
        attempt += 1


def refused_batch() -> device_pb2.ReportRequest:
    """A batch the control plane refuses as invalid whatever else it holds (bad scheme)."""
    now = dt.datetime.now(dt.UTC)
    batch = device_pb2.ReportRequest(batch_id=new_batch_id())
    batch.period_start.FromDatetime(now)
    batch.period_end.FromDatetime(now)
    batch.models.append(
        device_pb2.ModelStats(
            model=MODEL,
            version=1,
            variant="fp32",
            config="CPU/normal/t4/mem-normal",
            latency=device_pb2.LatencyHistogram(scheme="linear", count=1, sum_ns=1),
            inferences=1,
        )
    )
    return batch


@contextlib.asynccontextmanager
async def server_restart(holder):
    """The control plane goes away (stopped) and comes back on the same home and port."""
    cp = holder["cp"]
    await asyncio.to_thread(cp.stop)
    yield

    def again():
        for _ in range(50):  # the old listener may take a moment to let go of the port
            try:
                return serve(cp.config.home, cp.address)
            except Exception:  # noqa: BLE001 - a bind error
                pass
        raise AssertionError(f"cannot listen on {cp.address} again")

    holder["cp"] = await asyncio.to_thread(again)


@contextlib.asynccontextmanager
async def database_outage(holder):
    """The control plane stays up; its PostgreSQL database refuses every connection."""
    name = holder["db"].rsplit("/", 1)[1]
    admin = _pg_admin_engine()

    def allow(yes: bool) -> None:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(yes).lower()}'))
            if not yes:
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"
                    ),
                    {"d": name},
                )

    await asyncio.to_thread(allow, False)
    try:
        yield
    finally:
        await asyncio.to_thread(allow, True)
        admin.dispose()


@pytest.fixture(params=["restart", pytest.param("database", marks=pytest.mark.postgres)])
def outage(request, template_home, tmp_path):
    """(the control plane in a holder, how it goes away)."""
    if request.param == "restart":
        holder = {"cp": serve(copy_home(template_home, tmp_path))}
        yield holder, server_restart
    else:
        home, url = request.getfixturevalue("pg_template")
        db = request.getfixturevalue("pg_copy")(url)
        holder = {"cp": serve(copy_home(home, tmp_path), db=db), "db": db}
        yield holder, database_outage
    holder["cp"].stop()


def test_reports_wait_out_an_outage_and_arrive_once_in_order(outage):
    holder, going_away = outage

    async def scenario():
        cp = holder["cp"]
        async with FleetSimulator([cp.address], options=FAST, tls=cp.tls) as sim:
            await enrolled(sim, cp, N)
            await asyncio.to_thread(rollout, cp, 1, "", (100,), 0)
            await sim.wait_synced(MODEL, 1, installed=True, timeout=20)
            loads = {
                d.id: Recorded(d.id, d.identity.attributes, sim.seed, RATE) for d in sim.devices
            }
            wires = {d.id: Wire(d) for d in sim.devices}
            lossy, strict = sim.devices[0], sim.devices[1]

            for d in sim.devices:  # the control plane takes each period as it comes
                await one_period(d, loads[d.id])
                assert await d.flush_reports() == 1 and not len(d.outbox), d.failures

            # A reply lost after the batch was applied: sent again, unchanged.
            lost = await one_period(lossy, loads[lossy.id])
            wires[lossy.id].lose_reply_to = lost.batch_id
            assert await lossy.flush_reports() == 0 and len(lossy.outbox) == 1
            assert await lossy.flush_reports() == 1 and not len(lossy.outbox)
            assert wires[lossy.id].answered[-1] == (lost.batch_id, True)  # applied once
            assert wires[lossy.id].sent[-1] == wires[lossy.id].sent[-2]

            # Refused as invalid: dropped and counted, the next batch carries the count.
            strict.outbox.put(refused_batch())
            await one_period(strict, loads[strict.id])
            assert await strict.flush_reports() == 1 and not len(strict.outbox)
            assert strict.failures["report_invalid_argument"] == 1
            assert strict.outbox.dropped == 1 and wires[strict.id].sent[-1].dropped_batches == 1

            async with going_away(holder):
                for _ in range(ROUNDS_DOWN):
                    for d in sim.devices:
                        await one_period(d, loads[d.id])
                        assert await d.flush_reports() == 0
                assert [len(d.outbox) for d in sim.devices] == [ROUNDS_DOWN] * N
                assert all(d.failures["report_unavailable"] for d in sim.devices)
            await drain(sim)
            for d in sim.devices:  # and on it goes, back to back
                await one_period(d, loads[d.id])
            await drain(sim)
            assert sum(d.outbox.dropped for d in sim.devices) == 1
            return loads, wires

    loads, wires = asyncio.run(scenario())
    store = holder["cp"].app.store
    for device_id, load in loads.items():
        made = [(s, e, b) for s, e, b in load.periods if b is not None]
        assert len(made) >= 2 + ROUNDS_DOWN
        # Periods follow one another on the control plane's time, never overlapping.
        for (_, end, _), (start, _, _) in zip(load.periods, load.periods[1:], strict=False):
            assert start == end
        # Every period's figures arrived once: the server holds exactly what was made.
        stored = [
            (r.period_start, r.period_end, r.stats.inferences)
            for r in store.device_stats(device_id, since=EPOCH)
        ]
        assert stored == [(s, e, b.models[0].inferences) for s, e, b in made]
        # In order: what the control plane took, first time each, is the order made.
        taken = [batch_id for batch_id, duplicate in wires[device_id].answered if not duplicate]
        assert taken == [b.batch_id for _, _, b in made]


def test_the_queue_is_bounded_oldest_first_and_a_drop_count_is_sent_once():
    now = [0.0]
    queue = ReportQueue(max_bytes=300, max_age_s=60, monotonic=lambda: now[0])
    made = []
    for i in range(6):
        batch = device_pb2.ReportRequest(batch_id=f"b{i:07d}")
        batch.models.add(model="m" * 80)
        made.append(batch)
        queue.put(batch)
        now[0] += 1
    kept = 300 // made[0].ByteSize()
    assert len(queue) == kept == 3 and queue.dropped == 3
    # The oldest kept goes first and carries the count; sent again, it carries the same.
    first = queue.head()
    assert first is made[3] and first.dropped_batches == 3 and queue.unreported == 0
    assert queue.head() is first and first.dropped_batches == 3
    # Refused for good: it and the count it carried go to the next one.
    queue.refuse(first)
    second = queue.head()
    assert second is made[4] and second.dropped_batches == 4 and queue.dropped == 4
    queue.ack(second)
    assert len(queue) == 1 and queue.unreported == 0
    # Too old: dropped when the next batch comes (never the newest), and counted.
    now[0] += 61
    queue.put(device_pb2.ReportRequest(batch_id="bnewest0"))
    assert len(queue) == 1 and queue.dropped == 5
    newest = queue.head()
    assert newest.batch_id == "bnewest0" and newest.dropped_batches == 1
    queue.ack(newest)
    assert len(queue) == 0 and queue.head() is None
