"""The agent's pipelines against a stand-in for its serving models: the edges, quickly.

The end-to-end path (a real agent, a real model, gRPC) is in test_pipelines.py; here a
fake `Serving` answers each firing, so swaps, bounds and refusals can be timed and
counted exactly.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from device_agent import pipeline_results, pipelines
from device_agent.local_quotas import AppLimits, Overloaded, TokenBucket
from device_agent.pipelines import (
    MAX_EVENTS,
    Closed,
    EventsRejected,
    NoPipeline,
    Pipelines,
    Result,
    Subscription,
)
from device_agent.report_outbox import Collector
from protos import agent_pb2
from runtime.signature import Signature, TensorSpec

SIGNATURE = Signature((TensorSpec("x", (1, 2), "float32"),), ("y",))
NOW = time.time_ns() // 1_000_000


def spec(pattern: str = "a") -> dict:
    return {
        "event_types": ["a", "b"],
        "key_fields": ["k"],
        "value_fields": ["v"],
        "lateness_ms": 1000,
        "triggers": [
            {
                "name": "t",
                "pattern": pattern,
                "by": "k",
                "input": "x",
                "features": [
                    {"agg": "sum", "field": "v", "window": {"count": 4}},
                    {"agg": "count", "window": {"count": 4}},
                ],
            }
        ],
    }


class FakeModel:
    signature = SIGNATURE


class FakeServing:
    """What Pipelines needs of Serving: put, serving, is_loading, infer_batch."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.delay_s = delay_s
        self.slot: dict | None = None
        self.loading = False
        self.runs = self.calls = 0

    def put(self, name, info, model) -> None:
        self.slot = info

    def serving(self, name):
        return self.slot

    def is_loading(self, name) -> bool:
        return self.loading

    def infer_batch(self, name, batch):
        self.calls += 1
        answers = []
        for inputs in batch:
            time.sleep(self.delay_s)
            self.runs += 1
            answers.append({"y": inputs["x"] * 2})
        return self.slot, "CPU", answers


class FakeClock:
    """Monotonic seconds that move only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def slot(version: int, doc: dict | None) -> dict:
    return {"version": version, "uid": f"u{version}", "variant": "fp32", "pipeline": doc}


def events(ts, types=None, k=1, v=1.0) -> list[agent_pb2.Event]:
    types = types or ["a"] * len(ts)
    return [
        agent_pb2.Event(ts_ms=t, type=e, keys=[k], values=[v])
        for t, e in zip(ts, types, strict=True)
    ]


def push(p: Pipelines, evs, **kw):
    return p.push("m", ["k"], ["v"], evs, **kw)


def test_a_timestamp_far_in_the_future_is_refused_and_cannot_poison_the_watermark():
    p = Pipelines(FakeServing(), Collector())
    p.activate("m", slot(1, spec()), FakeModel())
    with pytest.raises(EventsRejected) as caught:
        push(p, events([NOW, NOW * 1000]))  # microseconds by mistake
    assert caught.value.reason == "ahead" and "event 1" in str(caught.value)
    assert push(p, events([NOW + 1])).firings == 1  # nothing of the bad batch applied
    with pytest.raises(EventsRejected) as caught:
        push(p, events([NOW - 60_000]))
    assert caught.value.reason == "late"


def test_a_push_bigger_than_its_memory_budget_is_refused_up_front(monkeypatch):
    monkeypatch.setattr(pipelines, "PUSH_BYTES", 10_000)
    p = Pipelines(FakeServing(), Collector())
    p.activate("m", slot(1, spec()), FakeModel())
    per_event = 2 * 8 + 256
    with pytest.raises(EventsRejected, match=f"at most {10_000 // per_event} per push"):
        push(p, events([NOW] * 100))
    assert push(p, events([NOW] * 30)).accepted == 30


def test_a_push_whose_caller_left_is_not_applied():
    serving = FakeServing()
    p = Pipelines(serving, Collector())
    p.activate("m", slot(1, spec()), FakeModel())
    with pytest.raises(EventsRejected) as caught:
        push(p, events([NOW]), cancelled=lambda: True)
    assert caught.value.reason == "cancelled" and serving.runs == 0
    assert push(p, events([NOW])).firings == 1


def test_a_swap_does_not_wait_for_pushes_queued_behind_the_one_in_flight():
    serving = FakeServing(delay_s=0.05)
    p = Pipelines(serving, Collector())
    p.activate("m", slot(1, spec()), FakeModel())
    stop, pushed = threading.Event(), []

    def pusher() -> None:
        t = NOW
        while not stop.is_set():
            t += 1
            pushed.append(push(p, events([t] * 4)).version)

    threads = [threading.Thread(target=pusher) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    started = time.monotonic()
    p.activate("m", slot(2, spec()), FakeModel())  # equal spec: state carried over
    took = time.monotonic() - started
    time.sleep(0.3)
    stop.set()
    for t in threads:
        t.join()
    # At most the push in flight (4 firings x 50 ms) stood in its way, not the queue.
    assert took < 0.6, took
    assert pushed[-1] == 2 and 1 in pushed


def test_loading_and_missing_models_and_a_closed_agent_are_told_apart():
    serving = FakeServing()
    p = Pipelines(serving, Collector())
    with pytest.raises(NoPipeline) as caught:
        push(p, events([NOW]))
    assert not caught.value.installed and "not installed" in str(caught.value)
    serving.loading = True
    with pytest.raises(NoPipeline) as caught:
        push(p, events([NOW]))
    assert caught.value.loading and "is loading" in str(caught.value)
    serving.loading = False
    p.activate("m", slot(1, None), FakeModel())
    with pytest.raises(NoPipeline, match="v1 has no event pipeline") as caught:
        push(p, events([NOW]))
    assert caught.value.installed and not caught.value.loading
    p.activate("m", slot(2, spec()), FakeModel())

    async def after_close() -> None:
        p.close()
        with pytest.raises(Closed):
            p.subscribe("m")

    asyncio.run(after_close())


def test_a_failed_carry_over_starts_the_new_pipeline_empty(monkeypatch):
    from runtime.pipeline import Pipeline

    p = Pipelines(FakeServing(), Collector())
    p.activate("m", slot(1, spec("a -> b")), FakeModel())
    push(p, events([NOW], ["a"]))

    def broken(self, old):
        raise MemoryError

    monkeypatch.setattr(Pipeline, "carry_over", broken)
    p.activate("m", slot(2, spec("a -> b")), FakeModel())
    # The partial match "a" did not survive; the swap did.
    assert push(p, events([NOW + 1], ["b"])).firings == 0
    assert push(p, events([NOW + 2, NOW + 3], ["a", "b"])).version == 2


def test_a_slow_subscriber_is_bounded_by_bytes_as_well_as_results(monkeypatch):
    monkeypatch.setattr(pipeline_results, "QUEUE_BYTES", 10_000)

    async def scenario() -> None:
        sub = Subscription("m", asyncio.get_running_loop())
        big = {"y": np.zeros(1000, np.float32)}  # 4 kB each
        for i in range(10):
            sub.offer(Result("m", 1, "t", i, i, 0, 1, outputs=big))
        sub.offer(None)
        first, dropped = await sub.next()
        assert dropped == 9 - 1 and first.key == 8  # two 4 kB results fit in 10 kB
        last, dropped = await sub.next()
        assert last.key == 9 and dropped == 0
        assert (await sub.next())[0] is None  # the end of the stream is never dropped

    asyncio.run(scenario())


def test_feature_values_that_overflow_the_input_dtype_fail_that_firing_only():
    serving = FakeServing()
    p = Pipelines(serving, Collector())
    p.activate("m", slot(1, spec()), FakeModel())
    done = push(p, events([NOW, NOW + 1], v=1e39))  # beyond float32's 3.4e38
    assert (done.firings, done.errors) == (2, 2) and serving.runs == 0
    assert push(p, events([NOW + 2], k=2, v=1.0)).errors == 0


def test_the_default_rate_lets_a_full_push_in_and_says_when_the_next_one_fits():
    clock = FakeClock()
    p = Pipelines(FakeServing(), Collector(), clock=clock)
    p.activate("m", slot(1, spec()), FakeModel())
    with pytest.raises(EventsRejected, match=f"at most {MAX_EVENTS}"):
        p.admit("m", MAX_EVENTS + 1)  # it would never fit: not a rate refusal
    p.admit("m", MAX_EVENTS)
    with pytest.raises(Overloaded, match="10000 events/s") as caught:
        p.admit("m", MAX_EVENTS)
    assert caught.value.retry_after_s == pytest.approx(MAX_EVENTS / 10_000)
    clock.advance(caught.value.retry_after_s)
    p.admit("m", MAX_EVENTS)
    with pytest.raises(NoPipeline):
        p.admit("other", 1)  # no bucket for a name that serves nothing


def test_firings_over_the_run_budget_are_run_and_hold_back_the_next_push():
    clock = FakeClock()
    serving = FakeServing()
    p = Pipelines(serving, Collector(), AppLimits(runs_per_s=10, runs_burst=5), clock)
    p.activate("m", slot(1, spec()), FakeModel())
    p.admit("m", 8)
    assert push(p, events([NOW + i for i in range(8)])).firings == 8  # never cut short
    assert serving.runs == 8
    with pytest.raises(Overloaded, match="10 model runs/s") as caught:
        p.admit("m", 1)
    assert caught.value.retry_after_s == pytest.approx(0.4)  # 3 overdrawn + 1 to run
    clock.advance(0.39)
    with pytest.raises(Overloaded):
        p.admit("m", 1)
    clock.advance(0.01)
    p.admit("m", 1)


def test_each_model_has_its_own_subscriber_slots_and_a_leaver_frees_one():
    p = Pipelines(FakeServing(), Collector(), AppLimits(subscribers=2))
    p.activate("m", slot(1, spec()), FakeModel())
    p.activate("n", slot(1, spec()), FakeModel())

    async def scenario() -> None:
        first, _ = p.subscribe("m"), p.subscribe("m")
        with pytest.raises(Overloaded, match="at most 2 per model") as caught:
            p.subscribe("m")
        assert caught.value.retry_after_s is None
        p.subscribe("n")
        p.unsubscribe(first)
        p.subscribe("m")

    asyncio.run(scenario())


def test_a_clock_stepping_back_neither_drains_nor_fills_a_bucket():
    clock = FakeClock()
    bucket = TokenBucket(10, 20, clock)
    bucket.take(20)
    clock.advance(-5)
    assert bucket.level() == 0
    clock.advance(5.5)  # back where it was, then half a second on
    assert bucket.level() == pytest.approx(5)
    with pytest.raises(ValueError, match="events_per_s must be > 0"):
        AppLimits(events_per_s=0)


def test_events_become_columns_in_the_pipelines_field_order():
    class Config:
        key_fields, value_fields = ("user", "shop"), ("amount", "dwell")

    evs = [
        agent_pb2.Event(ts_ms=NOW + i, type="ab"[i % 2], keys=[i, 100 + i], values=[i / 2, -i])
        for i in range(5)
    ]
    # Given in another order than the pipeline's: the columns come back in its order.
    ts, types, keys, values = pipelines._arrays(Config, ["shop", "user"], ["dwell", "amount"], evs)
    assert ts.tolist() == [NOW + i for i in range(5)] and types == list("ababa")
    assert keys.tolist() == [[100 + i, i] for i in range(5)]
    assert values.tolist() == [[-i, i / 2] for i in range(5)]
    assert keys.flags.c_contiguous and values.flags.c_contiguous
    empty = pipelines._arrays(Config, ["user", "shop"], ["amount", "dwell"], [])
    assert [len(column) for column in empty] == [0, 0, 0, 0]


@pytest.mark.parametrize("bad", [{"keys": [1]}, {"values": [1.0, 2.0, 3.0]}, {"keys": []}])
def test_an_event_with_the_wrong_number_of_fields_is_named(bad):
    class Config:
        key_fields, value_fields = ("user", "shop"), ("amount", "dwell")

    fields = {"keys": [1, 2], "values": [1.0, 2.0]}
    evs = [agent_pb2.Event(ts_ms=NOW, type="a", **fields) for _ in range(4)]
    evs.insert(3, agent_pb2.Event(ts_ms=NOW, type="a", **{**fields, **bad}))
    with pytest.raises(EventsRejected, match="^event 3: .* key_fields and value_fields name 2"):
        pipelines._arrays(Config, ["user", "shop"], ["amount", "dwell"], evs)


def test_a_batch_takes_what_waits_in_order_within_its_bounds(monkeypatch):
    monkeypatch.setattr(pipeline_results, "QUEUE_RESULTS", 6)

    async def scenario() -> None:
        sub = Subscription("m", asyncio.get_running_loop())
        kb = {"y": np.zeros(250, np.float32)}  # 1000 bytes of outputs, 1387 with the rest
        for i in range(8):  # two too many: the oldest two are dropped
            sub.offer(Result("m", 1, "t", i, i, 0, 1, outputs=kb))
        batch, ended = await sub.next_batch(3, 1 << 20)
        assert [(r.key, d) for r, d in batch] == [(2, 2), (3, 0), (4, 0)] and not ended
        batch, ended = await sub.next_batch(10, 2800)  # bytes: two results fit, not three
        assert [(r.key, d) for r, d in batch] == [(5, 0), (6, 0)] and not ended
        batch, _ = await sub.next_batch(10, 10)  # one result alone over the bytes still goes
        assert [r.key for r, _ in batch] == [7]
        waiting = asyncio.ensure_future(sub.next_batch(10, 1 << 20))
        await asyncio.sleep(0)
        assert not waiting.done()  # nothing waits: it waits
        sub.offer_all([Result("m", 1, "t", 8, 8, 0, 1)])
        sub.offer(None)
        batch, ended = await waiting
        assert [r.key for r, _ in batch] == [8] and ended  # the end comes with the last

    asyncio.run(scenario())


def test_the_end_of_the_stream_ends_a_batch_with_what_came_before_it():
    async def scenario() -> None:
        sub = Subscription("m", asyncio.get_running_loop())
        sub.offer_all([Result("m", 1, "t", i, i, 0, 1) for i in range(3)])
        sub.offer(None)
        batch, ended = await sub.next_batch(10, 1 << 20)
        assert [r.key for r, _ in batch] == [0, 1, 2] and ended

    asyncio.run(scenario())


def test_columns_give_the_same_arrays_as_events():
    class Config:
        key_fields, value_fields = ("user", "shop"), ("amount", "dwell")

    evs = [
        agent_pb2.Event(ts_ms=NOW + i, type="ab"[i % 3 // 2], keys=[i, 7 * i], values=[i, -i / 3])
        for i in range(7)
    ]
    columns = agent_pb2.EventColumns(
        ts_ms=[e.ts_ms for e in evs],
        types=[e.type for e in evs],
        keys=[k for e in evs for k in e.keys],
        values=[v for e in evs for v in e.values],
    )
    fields = (["shop", "user"], ["dwell", "amount"])  # not the pipeline's order
    rows = pipelines._arrays(Config, *fields, evs)
    cols = pipelines._arrays(Config, *fields, pipelines.Columns(columns))
    assert rows[1] == cols[1]
    for a, b in zip(rows[:1] + rows[2:], cols[:1] + cols[2:], strict=True):
        np.testing.assert_array_equal(a, b)
        assert a.dtype == b.dtype and b.flags.c_contiguous


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"types": ["a"]}, "columns: 1 types for 2 events of 1 key and 1 value fields"),
        ({"keys": [1, 2, 3]}, "columns: 3 keys for 2 events .* \\(2 expected\\)"),
        ({"values": []}, "columns: 0 values for 2 events"),
    ],
)
def test_columns_of_the_wrong_lengths_are_refused(bad, message):
    p = Pipelines(FakeServing(), Collector())
    p.activate("m", slot(1, spec()), FakeModel())
    good = {"ts_ms": [NOW, NOW + 1], "types": ["a", "b"], "keys": [1, 1], "values": [1.0, 2.0]}
    columns = pipelines.Columns(agent_pb2.EventColumns(**{**good, **bad}))
    with pytest.raises(EventsRejected, match=message):
        push(p, columns)
    assert push(p, pipelines.Columns(agent_pb2.EventColumns(**good))).accepted == 2
