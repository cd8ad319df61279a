"""Hostile and careless apps against PushEvents' columns and SubscribeBatches.

The local API (real gRPC on a Unix socket) in this process over a fake `Serving`, so
outputs can be shaped at will and runs counted; the engine is the real one.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading

import grpc
import numpy as np
import pytest

from contract.local_api import MAX_MESSAGE_BYTES
from device_agent import local_api, pipeline_results, pipelines
from device_agent.local_api import AgentServicer, socket_path, start_local_api
from device_agent.local_quotas import MAX_EVENTS, AppLimits
from device_agent.pipelines import Columns, EventsRejected, Pipelines
from device_agent.report_outbox import Collector
from protos import agent_pb2, agent_pb2_grpc
from tests.device_agent.subscriber import Subscriber
from tests.device_agent.test_pipelines_unit import NOW, FakeClock, FakeModel, slot, spec

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
I64 = np.iinfo(np.int64)
FIELDS = {"key_fields": ["k"], "value_fields": ["v"]}


class Serving:
    """A fake `Serving`: each firing's outputs are `outputs(x)` (x doubled by default)."""

    def __init__(self, outputs=None) -> None:
        self.outputs = outputs or (lambda x: {"y": x * 2})
        self.slot: dict | None = None
        self.runs = 0

    def put(self, name, info, model) -> None:
        self.slot = info

    def serving(self, name):
        return self.slot

    def is_loading(self, name) -> bool:
        return False

    def infer_batch(self, name, batch):
        self.runs += len(batch)
        return self.slot, "CPU", [self.outputs(inputs["x"]) for inputs in batch]


class Watched(Pipelines):
    """Pipelines that tell the test each time a subscription ends."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.left: queue.Queue[str] = queue.Queue()
        self.subs: list = []

    def subscribe(self, name):
        sub = super().subscribe(name)
        self.subs.append(sub)
        return sub

    def unsubscribe(self, sub) -> None:
        super().unsubscribe(sub)
        self.left.put(sub.model)


class FakeLocal:
    """The local API over a fake Serving of model "m" (the unit tests' spec)."""

    def __init__(self, state, limits: AppLimits, outputs=None, doc=None) -> None:
        self.state, self.clock = state, FakeClock()
        self.serving = Serving(outputs)
        self.pipelines = Watched(self.serving, Collector(), limits, self.clock)
        self.pipelines.activate("m", slot(1, doc or spec()), FakeModel())
        self.servicer = AgentServicer(self.serving, agent_pb2.StatusResponse, self.pipelines)
        self._started = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        assert self._started.wait(30)
        self.channel = grpc.insecure_channel(
            f"unix:{socket_path(state)}",
            options=[("grpc.max_receive_message_length", -1)],
        )
        self.stub = agent_pb2_grpc.AgentServiceStub(self.channel)

    async def _serve(self) -> None:
        self.loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        server, _ = await start_local_api(self.state, self.servicer)
        self._started.set()
        await self._stop.wait()
        self.pipelines.close()
        await server.stop(5)
        self.servicer.close()

    def on_loop(self, fn):
        """Run `fn` on the server's loop (after everything queued there) and return its value."""

        async def call():
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(30)

    def push(self, *, events=(), columns=None, **fields) -> agent_pb2.PushEventsResponse:
        request = agent_pb2.PushEventsRequest(
            model="m", events=list(events), columns=columns, **{**FIELDS, **fields}
        )
        return self.stub.PushEvents(request, timeout=60)

    def stop(self) -> None:
        """Stop the agent's local API (its subscriptions end first)."""
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(30)

    def close(self) -> None:
        self.stop()
        self.channel.close()


@pytest.fixture
def local(tmp_path):
    started: list[FakeLocal] = []

    def start(limits: AppLimits | None = None, **kw) -> FakeLocal:
        state = tmp_path / f"s{len(started)}"
        state.mkdir(mode=0o700)
        started.append(FakeLocal(state, limits or AppLimits(runs_burst=10**6), **kw))
        return started[-1]

    yield start
    for agent in started:
        agent.close()


def Reader(agent, *, batched: bool = True, model: str = "m") -> Subscriber:  # noqa: N802
    """A subscriber of `agent`'s model, SubscribeBatches unless not `batched`, subscribed."""
    reader = Subscriber(agent.stub, model, batched=batched)
    reader.subscribed()
    return reader


def rpc_error(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kw)
    return caught.value


def first_message(method, model: str = "m"):
    """Open a subscription with `method` and read its first message (or its error)."""
    return next(iter(method(agent_pb2.SubscribeRequest(model=model))))


def with_drops_cleared(result: agent_pb2.PipelineResult) -> agent_pb2.PipelineResult:
    copy = agent_pb2.PipelineResult()
    copy.CopyFrom(result)
    copy.dropped_before = 0
    return copy


def as_columns(evs) -> agent_pb2.EventColumns:
    return agent_pb2.EventColumns(
        ts_ms=[e.ts_ms for e in evs],
        types=[e.type for e in evs],
        keys=[k for e in evs for k in e.keys],
        values=[v for e in evs for v in e.values],
    )


def ev(ts, kind="a", k=1, v=1.0) -> agent_pb2.Event:
    return agent_pb2.Event(ts_ms=ts, type=kind, keys=[k], values=[v])


# -- columns ---------------------------------------------------------------------------------


def two_field_spec() -> dict:
    doc = spec()
    doc["key_fields"], doc["value_fields"] = ["k", "shop"], ["v", "w"]
    doc["triggers"][0]["features"] = [
        {"agg": "sum", "field": "v", "window": {"count": 4}},
        {"agg": "last", "field": "w", "window": {"count": 1}},
    ]
    return doc


def test_columns_and_events_fire_the_same_results_at_the_extremes(local):
    """int64 keys at both ends, fields given out of order, odd floats: the same firings."""
    rng = np.random.default_rng(7)
    keys = [I64.min, I64.max, -1, 0, 1, I64.min + 1, 42]
    evs = [
        agent_pb2.Event(
            ts_ms=NOW - 1000 + i,
            type="ab"[i % 3 == 2],
            keys=[keys[i % len(keys)], keys[(i + 1) % len(keys)]],  # (shop, k): reversed
            values=[float(rng.normal() * 1e30), -0.0 if i % 5 == 0 else float(rng.normal())],
        )
        for i in range(300)
    ]
    fields = {"key_fields": ["shop", "k"], "value_fields": ["w", "v"]}
    got = []
    for form in ("events", "columns"):
        agent = local(doc=two_field_spec())
        reader = Reader(agent)
        given = {"events": evs} if form == "events" else {"columns": as_columns(evs)}
        reply = agent.push(**given, **fields)
        assert (reply.accepted, reply.firings, reply.errors) == (300, 200, 0)
        got.append(reader.wait_for(200))
    assert got[0] == got[1]
    assert {r.key for r in got[0]} == set(keys)  # the extremes came through whole


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_values_are_refused_alike_in_both_forms(local, bad):
    agent = local()
    evs = [ev(NOW - 10, v=1.0), ev(NOW - 9, v=bad)]
    errors = [rpc_error(agent.push, events=evs), rpc_error(agent.push, columns=as_columns(evs))]
    assert {(e.code(), e.details()) for e in errors} == {
        (INVALID, f"event 1: value 'v' is {bad} (values must be finite)")
    }
    assert agent.serving.runs == 0


@pytest.mark.parametrize(
    "columns, fields, code, message",
    [
        (dict(types=["a"]), {}, INVALID, "columns: 1 types for 2 events of 1 key and 1 value"),
        (dict(keys=[1, 2, 3]), {}, INVALID, "columns: 3 keys for 2 events .* \\(2 expected\\)"),
        (dict(values=[1.0]), {}, INVALID, "columns: 1 values for 2 events"),
        (dict(ts_ms=[]), {}, INVALID, "columns: 2 types for 0 events"),
        (dict(types=["a", "zz" * 1000]), {}, INVALID, "event 1: type 'zzz.*is not one of"),
        (dict(ts_ms=[NOW, NOW * 1000]), {}, INVALID, "event 1: ts .* ahead of this device"),
        (dict(ts_ms=[NOW, NOW - 3_600_000]), {}, grpc.StatusCode.OUT_OF_RANGE, "late"),
        (
            dict(ts_ms=[NOW, I64.min]),
            {},
            INVALID,
            r"event 1: timestamp -9223372036854775808 is outside \[0, 2\*\*62\]",
        ),
        ({}, {"key_fields": ["k", "k"]}, INVALID, "key_fields must name the pipeline's"),
        ({}, {"key_fields": []}, INVALID, "key_fields must name the pipeline's"),
        ({}, {"value_fields": ["x"]}, INVALID, "value_fields must name the pipeline's"),
    ],
)
def test_bad_columns_are_refused_by_name_and_nothing_is_applied(
    local, columns, fields, code, message
):
    agent = local()
    reader = Reader(agent)
    good = {"ts_ms": [NOW - 10, NOW - 9], "types": ["a", "a"], "keys": [1, 1], "values": [1.0, 2.0]}
    error = rpc_error(agent.push, columns=agent_pb2.EventColumns(**{**good, **columns}), **fields)
    assert error.code() == code, error.details()
    import re

    assert re.search(message, error.details()), error.details()
    assert agent.serving.runs == 0
    # Nothing of it was applied: the sum window holds only the good push's value.
    agent.push(columns=agent_pb2.EventColumns(ts_ms=[NOW - 5], types=["a"], keys=[1], values=[4]))
    (result,) = reader.wait_for(1)
    assert result.dropped_before == 0 and result.event_ts_ms == NOW - 5
    x = np.frombuffer(result.outputs[0].data, np.float32)
    assert list(x) == [8.0, 2.0]  # (sum 4, count 1) doubled


def test_events_and_columns_together_are_refused_even_an_empty_columns(local):
    agent = local()
    for columns in (as_columns([ev(NOW)]), agent_pb2.EventColumns()):
        error = rpc_error(agent.push, events=[ev(NOW)], columns=columns)
        assert error.code() == INVALID and error.details() == "give events or columns, not both"
    assert agent.serving.runs == 0


def test_an_empty_columns_message_is_an_empty_push(local):
    agent = local()
    reply = agent.push(columns=agent_pb2.EventColumns())
    assert (reply.accepted, reply.firings) == (0, 0)
    assert agent.push(columns=as_columns([ev(NOW)])).firings == 1


def test_columns_at_max_events_get_in_and_one_more_does_not(local):
    agent = local()
    n = MAX_EVENTS
    columns = agent_pb2.EventColumns(
        ts_ms=[NOW - 1000] * n, types=["b"] * n, keys=[1] * n, values=[0.5] * n
    )
    assert agent.push(columns=columns).accepted == n
    agent.clock.advance(3600)
    columns.ts_ms.append(NOW - 1000)
    columns.types.append("b")
    columns.keys.append(1)
    columns.values.append(0.5)
    error = rpc_error(agent.push, columns=columns)
    assert error.code() == INVALID
    assert error.details() == f"{n + 1} events in one push; at most {n}"


def test_columns_are_counted_against_the_rate_like_events(local):
    agent = local(AppLimits(events_per_s=100, events_burst=100))
    cols = as_columns([ev(NOW - 100 + i, "b") for i in range(60)])
    assert agent.push(columns=cols).accepted == 60
    error = rpc_error(agent.push, columns=cols)
    assert error.code() == EXHAUSTED
    assert "this push of 60 events fits in 0.200 s" in error.details()
    big = as_columns([ev(NOW - 100, "b")] * 101)
    error = rpc_error(agent.push, columns=big)
    assert error.code() == INVALID and error.details() == "101 events in one push; at most 100"
    # A columns message with one ts and a flood of keys is one event for the rate, and
    # refused on its lengths before any of it is read.
    agent.clock.advance(10)
    flood = agent_pb2.EventColumns(ts_ms=[NOW], types=["a"], keys=[1] * 1_000_000, values=[1])
    error = rpc_error(agent.push, columns=flood)
    assert error.code() == INVALID and "1000000 keys for 1 events" in error.details()
    assert agent.serving.runs == 0


def test_columns_are_bounded_by_push_bytes_like_events(local, monkeypatch):
    monkeypatch.setattr(pipelines, "PUSH_BYTES", 10_000)
    agent = local()
    per_event = 2 * 8 + 256
    for given in ({"events": [ev(NOW)] * 100}, {"columns": as_columns([ev(NOW)] * 100)}):
        error = rpc_error(agent.push, **given)
        assert error.code() == INVALID
        assert error.details().endswith(f"takes at most {10_000 // per_event} per push")
    assert agent.serving.runs == 0


def test_columns_unit_error_names_lengths():
    class Config:
        key_fields, value_fields = ("k",), ("v",)

    cols = Columns(agent_pb2.EventColumns(ts_ms=[1, 2], types=["a", "a"], keys=[1], values=[1]))
    with pytest.raises(EventsRejected, match="columns: 1 keys for 2 events"):
        pipelines._arrays(Config, ["k"], ["v"], cols)


# -- SubscribeBatches ------------------------------------------------------------------------


def test_batches_keep_firing_order_under_concurrent_pushes_like_subscribe(local):
    agent = local()
    batched, plain = Reader(agent), Reader(agent, batched=False)
    apps, pushes, per_push = 4, 25, 20
    start = threading.Barrier(apps)

    def app(a: int) -> None:
        client = agent_pb2_grpc.AgentServiceStub(
            grpc.insecure_channel(f"unix:{socket_path(agent.state)}")
        )
        start.wait()
        for i in range(pushes):
            # key: app and push, value: the push's index; ts the same for all (not late)
            evs = [ev(NOW - 1000, k=a * 1000 + i, v=j) for j in range(per_push)]
            form = {"columns": as_columns(evs)} if i % 2 else {"events": evs}
            request = agent_pb2.PushEventsRequest(model="m", **form, **FIELDS)
            assert client.PushEvents(request, timeout=60).firings == per_push

    threads = [threading.Thread(target=app, args=(a,)) for a in range(apps)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    total = apps * pushes * per_push
    # Subscribe (a message a result) may fall behind and lose the oldest; it says so.
    shown = plain.wait_accounted(total)
    got = batched.wait_accounted(total)
    assert all(r.dropped_before == 0 for r in got)
    assert len(got) == total
    left = iter(got)  # what Subscribe showed is what SubscribeBatches did, less drops
    assert all(any(r == g for g in left) for r in (with_drops_cleared(r) for r in shown))
    # Each push's firings together and in order; each app's pushes in its order.
    keys = [r.key for r in got]
    runs = [keys[i : i + per_push] for i in range(0, total, per_push)]
    assert all(len(set(run)) == 1 for run in runs)
    for a in range(apps):
        mine = [run[0] for run in runs if run[0] // 1000 == a]
        assert mine == [a * 1000 + i for i in range(pushes)]
    assert len(batched.messages) <= apps * pushes


def test_a_batch_never_holds_more_than_its_bounds(local):
    sizes = {1: 6 << 20, 2: 1 << 20}  # by key: one result alone over BATCH_BYTES, then 1 MB
    agent = local(outputs=lambda x: {"y": np.zeros(sizes.get(int(x[0, 1]), 4) // 4, "f4")})
    reader = Reader(agent)
    # Keys 0..2999 each fire once; count (x[0, 1]) is 1 for all but those pushed again.
    evs = [ev(NOW - 100, k=k) for k in range(3000)]
    assert agent.push(events=evs).firings == 3000
    evs = [ev(NOW - 99, k=k) for k in range(5)]  # counts 2: 1 MB outputs each
    assert agent.push(events=evs).firings == 5
    got = reader.wait_for(3005 - sum(r.dropped_before for r in reader.wait_for(1)))
    assert [r.key for r in got[-5:]] == list(range(5))
    for count, size in reader.messages:
        assert count <= local_api.BATCH_RESULTS
        assert count == 1 or size <= local_api.BATCH_BYTES + count * 300, (count, size)
        assert size <= MAX_MESSAGE_BYTES


def test_a_batch_message_stays_under_the_message_limit_with_many_named_outputs(local):
    """Names count: 100 outputs of 4 bytes named in 1 kB each are 100 kB a result."""
    names = [f"output_{i:04d}_" + "n" * 1000 for i in range(100)]
    one = np.float32(1.0)
    agent = local(outputs=lambda x: {name: np.asarray(one) for name in names})
    batched, plain = Reader(agent), Reader(agent, batched=False)
    n = 700  # 70 MB as messages: once sent as one message over MAX_MESSAGE_BYTES
    assert agent.push(events=[ev(NOW - 100, k=i) for i in range(n)]).firings == n
    for reader in (plain, batched):  # the oldest may be dropped (QUEUE_BYTES), and said so
        got = reader.wait_accounted(n)
        assert [r.key for r in got] == sorted(r.key for r in got)
        assert reader.error is None and not reader.ended
    assert len(batched.messages) > 1
    assert max(size for _, size in batched.messages) <= local_api.BATCH_BYTES


def test_a_reader_that_never_reads_holds_bounded_memory_and_learns_of_drops(local, monkeypatch):
    monkeypatch.setattr(pipeline_results, "QUEUE_BYTES", 1 << 20)
    agent = local(outputs=lambda x: {"y": np.zeros(16_384, np.float32)})  # 64 kB each
    call = agent.stub.SubscribeBatches(agent_pb2.SubscribeRequest(model="m"))
    call.initial_metadata()
    (sub,) = agent.pipelines.subs
    fired = 0
    for i in range(10):  # 1000 results, 64 MB of outputs
        fired += agent.push(events=[ev(NOW - 100 + i, k=k) for k in range(100)]).firings
        held = agent.on_loop(lambda: (len(sub._queue), sub._bytes))
        assert held[0] <= pipeline_results.QUEUE_RESULTS and held[1] <= 1 << 20, held
    got, dropped, last = 0, 0, (-1, -1)
    for message in call:
        for r in message.results:
            got += 1
            dropped += r.dropped_before
            assert (r.event_ts_ms, r.key) > last  # in firing order, nothing twice
            last = (r.event_ts_ms, r.key)
        if got + dropped == fired:
            break
    assert dropped > 0 and got + dropped == fired
    call.cancel()
    assert agent.pipelines.left.get(timeout=30) == "m"


def test_cancelling_a_stuck_batched_stream_frees_its_slot(local):
    agent = local(
        AppLimits(subscribers=1, runs_burst=10**6),
        outputs=lambda x: {"y": np.zeros(262_144, np.float32)},
    )  # 1 MB each
    call = agent.stub.SubscribeBatches(agent_pb2.SubscribeRequest(model="m"))
    call.initial_metadata()
    for i in range(4):  # 64 MB waiting: the handler is stuck sending
        agent.push(events=[ev(NOW - 100 + i, k=k) for k in range(16)])
    error = rpc_error(
        lambda: next(iter(agent.stub.SubscribeBatches(agent_pb2.SubscribeRequest(model="m"))))
    )
    assert error.code() == EXHAUSTED
    call.cancel()
    assert agent.pipelines.left.get(timeout=30) == "m"
    reader = Reader(agent)
    agent.push(events=[ev(NOW, k=99)])
    assert reader.wait_for(1)[0].key == 99


def test_batched_streams_end_cleanly_when_the_agent_stops_after_what_was_waiting(local):
    agent = local()
    readers = [Reader(agent), Reader(agent, batched=False)]
    assert agent.push(events=[ev(NOW - 100, k=k) for k in range(50)]).firings == 50
    agent.stop()
    for reader in readers:
        assert reader.wait_ended() is None
        assert [r.key for r in reader.results] == list(range(50))


def test_batched_streams_survive_a_version_without_pipeline(local):
    agent = local()
    reader = Reader(agent)
    agent.pipelines.activate("m", slot(2, None), FakeModel())
    error = rpc_error(agent.push, events=[ev(NOW)])
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "v2 has no event pipeline" in error.details()
    error = rpc_error(
        lambda: next(iter(agent.stub.SubscribeBatches(agent_pb2.SubscribeRequest(model="m"))))
    )
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    agent.pipelines.activate("m", slot(3, spec()), FakeModel())
    agent.push(events=[ev(NOW, k=5)])
    (result,) = reader.wait_for(1)
    assert (result.version, result.key) == (3, 5) and not reader.ended


def test_batched_and_plain_subscribers_share_the_slots(local):
    agent = local(AppLimits(subscribers=4, runs_burst=10**6))
    readers = [Reader(agent, batched=i % 2 == 0) for i in range(4)]
    for subscribe in (agent.stub.Subscribe, agent.stub.SubscribeBatches):
        error = rpc_error(first_message, subscribe)
        assert error.code() == EXHAUSTED and "already has 4 subscribers" in error.details()
    readers.pop(0).call.cancel()
    assert agent.pipelines.left.get(timeout=30) == "m"
    readers.append(Reader(agent))
    agent.push(events=[ev(NOW, k=1)])
    for reader in readers:
        assert reader.wait_for(1)[0].key == 1


@pytest.mark.parametrize("model", ["", "x" * 100_000, "Not A Name"], ids=["empty", "long", "bad"])
def test_a_model_name_that_cannot_be_one_is_refused_readably(local, model):
    agent = local()
    calls = [
        lambda: next(iter(agent.stub.SubscribeBatches(agent_pb2.SubscribeRequest(model=model)))),
        lambda: next(iter(agent.stub.Subscribe(agent_pb2.SubscribeRequest(model=model)))),
        lambda: agent.stub.PushEvents(agent_pb2.PushEventsRequest(model=model), timeout=30),
    ]
    for call in calls:
        error = rpc_error(call)
        assert error.code() == INVALID, error.details()
        assert len(error.details()) < 200
    assert agent.pipelines.left.empty() and not agent.pipelines.subs


def test_batch_bounds_are_the_documented_ones():
    assert local_api.BATCH_RESULTS == 1024 and local_api.BATCH_BYTES == 4 << 20
    assert local_api.BATCH_BYTES < MAX_MESSAGE_BYTES
