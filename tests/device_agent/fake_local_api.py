"""A local API for review tests: real gRPC on a Unix socket, in this process, over a
fake `Serving` (outputs shaped at will, runs counted) and the real stream engine."""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading

import grpc
import pytest

from device_agent.local_api import AgentServicer, socket_path, start_local_api
from device_agent.local_quotas import AppLimits
from device_agent.pipelines import Pipelines
from device_agent.report_outbox import Collector
from protos import agent_pb2, agent_pb2_grpc
from tests.device_agent.subscriber import Subscriber
from tests.device_agent.test_pipelines_unit import FakeClock, FakeModel, slot, spec

INVALID = grpc.StatusCode.INVALID_ARGUMENT
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
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


async def _no_status() -> agent_pb2.StatusResponse:
    return agent_pb2.StatusResponse()


class FakeLocal:
    """The local API over a fake Serving of model "m" (the unit tests' spec)."""

    def __init__(self, state, limits: AppLimits, outputs=None, doc=None) -> None:
        self.state, self.clock = state, FakeClock()
        self.serving = Serving(outputs)
        self.pipelines = Watched(self.serving, Collector(), limits, self.clock)
        self.pipelines.activate("m", slot(1, doc or spec()), FakeModel())
        self.servicer = AgentServicer(self.serving, _no_status, self.pipelines)
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


@contextlib.contextmanager
def fake_locals(tmp_path):
    """Yield `start(limits=None, **kw)`, which starts a FakeLocal; all are closed after."""
    started: list[FakeLocal] = []

    def start(limits: AppLimits | None = None, **kw) -> FakeLocal:
        state = tmp_path / f"s{len(started)}"
        state.mkdir(mode=0o700)
        started.append(FakeLocal(state, limits or AppLimits(runs_burst=10**6), **kw))
        return started[-1]

    try:
        yield start
    finally:
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
