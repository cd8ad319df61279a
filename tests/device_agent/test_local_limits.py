"""Apps flooding the local API: pushes over the rate and subscribers over the count.

The local API (real gRPC on a Unix socket) in this process, over a real model (det v3:
the tiny MLP with the sample shopping pipeline, in its worker), so the rate bound's
clock can be a fake one that moves only when the test says so. The agent around it (sync,
install) is in test_pipelines.py.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from control_plane.demo import sample_models
from control_plane.demo.sample_pipeline import activity_pipeline
from device_agent.local_api import AgentServicer, socket_path, start_local_api
from device_agent.local_quotas import AppLimits
from device_agent.pipelines import Pipelines
from device_agent.report_outbox import Collector
from device_agent.serving import Serving
from protos import agent_pb2, agent_pb2_grpc
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_pipelines import FIELDS, Subscriber, push, rpc_error
from tests.device_agent.test_pipelines_unit import FakeClock
from tests.device_agent.test_serving import X, stub, to_array, to_tensor

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PUSHBACK = "grpc-retry-pushback-ms"


class Watched(Pipelines):
    """Pipelines that tell the test each time a subscription ends."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self.left: queue.Queue[str] = queue.Queue()

    def unsubscribe(self, sub) -> None:
        super().unsubscribe(sub)
        self.left.put(sub.model)


class LocalAgent:
    """The local API over det v3 in this process, its socket in `state`."""

    def __init__(self, state: Path, mnn: bytes, limits: AppLimits) -> None:
        from runtime import Model

        self.state, self.clock = state, FakeClock()
        self.collector = Collector()
        self.serving = Serving(self.collector)
        self.pipelines = Watched(self.serving, self.collector, limits, self.clock)
        model = Model.from_bytes(mnn, isolation="worker", version=f"{MODEL}:3")
        self.model_outputs = model.run({"x": X})
        info = {"version": 3, "uid": "u3", "variant": "fp32", "pipeline": activity_pipeline()}
        self.pipelines.activate(MODEL, info, model)
        self.servicer = AgentServicer(self.serving, self._status, self.pipelines)
        self._started, self._failed = threading.Event(), None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        assert self._started.wait(30) and self._failed is None, self._failed

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        try:
            server, _ = await start_local_api(self.state, self.servicer)
        except Exception as exc:  # noqa: BLE001 - told to the test thread
            self._failed = exc
            self._started.set()
            return
        self._started.set()
        await self._stop.wait()
        self.pipelines.close()
        await server.stop(5)
        self.servicer.close()

    async def _status(self) -> agent_pb2.StatusResponse:
        live = self.serving.status()
        return agent_pb2.StatusResponse(
            device_id="local",
            models=[
                agent_pb2.ModelStatus(model=name, active_version=m["version"], serving=True)
                for name, m in sorted(live.items())
            ],
        )

    def runs(self) -> int:
        """Return how many times the model ran (Infer and firings alike)."""
        return self.collector.totals().get(MODEL, (0, 0))[0]

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        self.serving.close()


@pytest.fixture(scope="module")
def mnn() -> bytes:
    return sample_models.onnx_to_mnn_bytes(sample_models.tiny_mlp_onnx(seed=3))


@pytest.fixture
def local(tmp_path, mnn):
    """Start the local API with given limits (one per test)."""
    started: list[LocalAgent] = []

    def start(limits: AppLimits) -> LocalAgent:
        state = tmp_path / "s"
        state.mkdir(mode=0o700)
        started.append(LocalAgent(state, mnn, limits))
        return started[-1]

    yield start
    for agent in started:
        agent.close()


# Ten minutes ago: well inside the pipeline's clock checks, whatever the test's pace.
T0 = time.time_ns() // 1_000_000 - 600_000


def checkouts(users, ts: int = T0) -> list[agent_pb2.Event]:
    """A tap then a purchase per user: each user fires the checkout trigger once."""
    taps = [agent_pb2.Event(ts_ms=ts, type="tap", keys=[u], values=[300.0, 0.0]) for u in users]
    buys = [
        agent_pb2.Event(ts_ms=ts + 1, type="purchase", keys=[u], values=[0.0, 5.0]) for u in users
    ]
    return taps + buys


def purchases(users, ts: int) -> list[agent_pb2.Event]:
    """Purchases alone: they fire only for users whose tap the pipeline holds."""
    return [agent_pb2.Event(ts_ms=ts, type="purchase", keys=[u], values=[0.0, 5.0]) for u in users]


def pushback(error: grpc.RpcError) -> str | None:
    return dict(error.trailing_metadata() or ()).get(PUSHBACK)


def test_a_flood_of_pushes_is_refused_whole_while_other_callers_are_served(local):
    agent = local(AppLimits(events_per_s=100, events_burst=200, runs_burst=10_000))
    sub = Subscriber(agent.state)
    sub.subscribed()
    assert push(agent.state, checkouts([1])).firings == 1  # in rate: applied; 198 left

    # 4 apps push 15 batches of 50 events each (25 checkouts), no time passing: the
    # first 3 batches fit the burst, the other 57 are refused; meanwhile another app's
    # Infer and Status calls are answered.
    batches = {  # users 1000 and up: none of them has pushed before
        (app, i): range((app * 100 + i + 1) * 1000, (app * 100 + i + 1) * 1000 + 25)
        for app in range(4)
        for i in range(15)
    }
    outcomes: dict = {}
    start = threading.Barrier(5)

    def flood(app: int) -> None:
        client = stub(agent.state)  # a channel of its own, as another app's
        start.wait()
        for i in range(15):
            events = checkouts(batches[app, i], T0 + 10)
            request = agent_pb2.PushEventsRequest(model=MODEL, events=events, **FIELDS)
            try:
                outcomes[app, i] = client.PushEvents(request, timeout=60)
            except grpc.RpcError as exc:
                outcomes[app, i] = exc

    apps = [threading.Thread(target=flood, args=(app,)) for app in range(4)]
    for thread in apps:
        thread.start()
    other = stub(agent.state)
    start.wait()
    for _ in range(20):
        reply = other.Infer(
            agent_pb2.InferRequest(model=MODEL, inputs=[to_tensor("x", X)]), timeout=30
        )
        assert reply.version == 3
        np.testing.assert_array_equal(
            to_array(reply.outputs[0]), next(iter(agent.model_outputs.values()))
        )
        assert other.Status(agent_pb2.StatusRequest(), timeout=30).models[0].active_version == 3
    for thread in apps:
        thread.join(60)

    applied = {k: v for k, v in outcomes.items() if isinstance(v, agent_pb2.PushEventsResponse)}
    refused = {k: v for k, v in outcomes.items() if isinstance(v, grpc.RpcError)}
    assert len(applied) == 3 and len(refused) == 57, outcomes
    assert all((r.accepted, r.firings, r.errors) == (50, 25, 0) for r in applied.values())
    for error in refused.values():
        assert error.code() == EXHAUSTED, error.details()
        assert "limited to 100 events/s (bursts of 200)" in error.details(), error.details()
        assert "this push of 50 events fits in 0.020 s" in error.details(), error.details()
        assert pushback(error) == "20"  # 48 events left, 2 more at 100/s

    # The advised wait is exactly enough; a moment less is not.
    agent.clock.advance(0.019)
    error = rpc_error(push, agent.state, purchases([0] * 50, T0 + 20))
    assert error.code() == EXHAUSTED and pushback(error) == "1"
    agent.clock.advance(0.001)
    # Purchases by the first 50 users of refused batches: no tap of theirs was applied.
    users = [u for key in sorted(refused) for u in batches[key]][:50]
    reply = push(agent.state, purchases(users, T0 + 20))
    assert (reply.accepted, reply.firings) == (50, 0)

    # The subscriber got each admitted firing once and nothing else (results come in
    # firing order: the last checkout's is the 77th).
    agent.clock.advance(1)
    assert push(agent.state, checkouts([2], T0 + 30)).firings == 1
    results = sub.wait_for(77)
    fired = {1, 2} | {u for key in applied for u in batches[key]}
    assert {r.key for r in results} == fired and results[-1].key == 2
    assert agent.runs() == 77 + 20  # the firings and the other app's Infer calls
    assert sub.error is None


def test_firings_over_the_run_budget_hold_back_the_next_push_and_say_until_when(local):
    agent = local(AppLimits(runs_per_s=10, runs_burst=5))
    reply = push(agent.state, checkouts(range(8)))
    assert (reply.accepted, reply.firings) == (16, 8)  # a push is never cut short
    error = rpc_error(push, agent.state, checkouts([9], T0 + 10))
    assert error.code() == EXHAUSTED
    assert "limited to 10 model runs/s (bursts of 5), used up for 0.400 s" in error.details()
    assert pushback(error) == "400"  # 3 overdrawn, and 1 to run
    agent.clock.advance(0.4)
    assert push(agent.state, checkouts([9], T0 + 10)).firings == 1
    assert agent.runs() == 9


def test_subscribers_beyond_the_limit_are_refused_until_one_leaves(local):
    agent = local(AppLimits(subscribers=3))
    # Batched subscriptions hold the same slots.
    subs = [Subscriber(agent.state), Subscriber(agent.state, batched=True)]
    channel = grpc.insecure_channel(f"unix:{socket_path(agent.state)}")
    request = agent_pb2.SubscribeRequest(model=MODEL)
    silent = agent_pb2_grpc.AgentServiceStub(channel).Subscribe(request)
    silent.initial_metadata()
    for sub in subs:
        sub.subscribed()
    extra = Subscriber(agent.state, batched=True)
    error = extra.wait_ended()
    assert error is not None and error.code() == EXHAUSTED, error
    assert f"{MODEL} already has 3 subscribers, at most 3 per model" in error.details()
    assert pushback(error) is None
    assert agent.pipelines.left.empty()  # a refused one never held a slot

    # A cancelled stream frees its slot, and so does an app that goes without a word.
    subs.pop(0).cancel()
    assert agent.pipelines.left.get(timeout=30) == MODEL
    subs.append(Subscriber(agent.state))
    subs[-1].subscribed()
    channel.close()
    assert agent.pipelines.left.get(timeout=30) == MODEL
    subs.append(Subscriber(agent.state))
    subs[-1].subscribed()

    # The 3 holding slots get each result.
    assert push(agent.state, checkouts([7])).firings == 1
    for sub in subs:
        assert [r.key for r in sub.wait_for(1)] == [7]
        assert sub.error is None
