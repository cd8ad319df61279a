"""Hostile and careless apps against SubscribeBatches, on a local API over a fake Serving
(tests/device_agent/fake_local_api.py)."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import pytest

from contract.local_api import MAX_MESSAGE_BYTES
from device_agent import local_api, pipeline_results
from device_agent.local_api import socket_path
from device_agent.local_quotas import AppLimits
from protos import agent_pb2, agent_pb2_grpc
from tests.device_agent.fake_local_api import (
    EXHAUSTED,
    FIELDS,
    INVALID,
    Reader,
    as_columns,
    ev,
    fake_locals,
    first_message,
    rpc_error,
    with_drops_cleared,
)
from tests.device_agent.test_pipelines_unit import NOW, FakeModel, slot, spec


@pytest.fixture
def local(tmp_path):
    with fake_locals(tmp_path) as start:
        yield start


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
        lambda: agent.stub.Infer(agent_pb2.InferRequest(model=model), timeout=30),
        lambda: next(iter(agent.stub.Generate(agent_pb2.GenerateRequest(model=model)))),
    ]
    for call in calls:
        error = rpc_error(call)
        assert error.code() == INVALID, error.details()
        assert len(error.details()) < 200
    assert agent.pipelines.left.empty() and not agent.pipelines.subs


def test_batch_bounds_are_the_documented_ones():
    assert local_api.BATCH_RESULTS == 1024 and local_api.BATCH_BYTES == 4 << 20
    assert local_api.BATCH_BYTES < MAX_MESSAGE_BYTES
