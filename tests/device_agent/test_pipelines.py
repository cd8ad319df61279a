"""Event pipelines on a real agent: events in, model results out to subscribed apps."""

from __future__ import annotations

import time

import grpc
import numpy as np
import pytest

from control_plane.demo import sample_models
from control_plane.demo.sample_pipeline import activity_events, activity_pipeline, event_messages
from protos import agent_pb2
from runtime.pipeline import Pipeline, parse_pipeline
from tests.device_agent import subscriber
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_agent import rollout
from tests.device_agent.test_serving import (
    device_id,
    fleet_show,
    start_daemon,
    stop_daemon,
    stub,
    to_array,
    to_tensor,
    wait_serving,
)

INVALID = grpc.StatusCode.INVALID_ARGUMENT
FIELDS = {"key_fields": ["user"], "value_fields": ["dwell_ms", "amount"]}


def push_pipeline_version(cp, tmp_path) -> int:
    """Push det v3: the tiny MLP with the sample pipeline."""
    path = tmp_path / "det-3.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=3))
    with cp.client() as client:
        return client.push(path, name=MODEL, pipeline=activity_pipeline()).version


events_pb = event_messages


def push(state, events, model=MODEL, **fields) -> agent_pb2.PushEventsResponse:
    request = agent_pb2.PushEventsRequest(model=model, events=events, **{**FIELDS, **fields})
    return stub(state).PushEvents(request, timeout=60)


class Subscriber(subscriber.Subscriber):
    """An app reading the results of a model (MODEL by default) on the agent of `state`."""

    def __init__(self, state, model=MODEL, *, batched=False) -> None:
        super().__init__(stub(state), model, batched=batched)


def rpc_error(call, *args, **kw) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kw)
    return caught.value


def test_events_fire_the_pipeline_and_results_reach_subscribers(cp, tmp_path):
    version = push_pipeline_version(cp, tmp_path)
    state = tmp_path / "s"
    proc = start_daemon(cp, state)
    sub = None
    try:
        rollout(cp, version)
        wait_serving(state, version, proc)
        status = stub(state).Status(agent_pb2.StatusRequest(), timeout=10)
        assert list(status.models[0].pipeline_triggers) == ["checkout"]
        sub, batches = Subscriber(state), Subscriber(state, batched=True)
        sub.subscribed()  # registered before the first push
        batches.subscribed()

        # The same events through a local copy of the pipeline give the expected inputs.
        spec = parse_pipeline(activity_pipeline())
        local = Pipeline(spec, spec.fit([{"name": "x", "shape": [1, 16], "dtype": "float32"}]))
        ts, types, keys, values = activity_events(600, users=10, seed=4)
        expected = []
        fired = 0
        for lo in range(0, 600, 200):
            batch = (
                ts[lo : lo + 200],
                types[lo : lo + 200],
                keys[lo : lo + 200],
                values[lo : lo + 200],
            )
            expected += local.push(*batch)
            reply = push(state, events_pb(*batch))
            assert reply.version == version and reply.accepted == 200 and reply.errors == 0
            fired += reply.firings
        assert fired == len(expected) > 10
        results = sub.wait_for(fired)
        assert [(r.trigger, r.key, r.event_ts_ms) for r in results] == [
            ("checkout", f.key, f.ts) for f in expected
        ]
        # In batches: the same results, in the same order, at most one message a push.
        assert batches.wait_for(fired) == results
        assert len(batches.messages) <= 3 < fired
        batches.cancel()
        for result, firing in list(zip(results, expected, strict=True))[:5]:
            assert result.version == version and not result.error
            direct = stub(state).Infer(
                agent_pb2.InferRequest(model=MODEL, inputs=[to_tensor("x", firing.inputs["x"])]),
                timeout=30,
            )
            np.testing.assert_array_equal(to_array(result.outputs[0]), to_array(direct.outputs[0]))
            assert result.window_start_ms < result.window_end_ms

        # Bad batches: a clear error naming the event, nothing applied, the agent stays up.
        t0 = int(ts[-1]) + 10
        good = events_pb([t0], ["tap"], [[1]], [[10.0, 0.0]])[0]
        for events, fields, fragment in [
            (
                [good, agent_pb2.Event(ts_ms=t0, type="refund", keys=[1], values=[0, 0])],
                {},
                "event 1: type 'refund'",
            ),
            (
                [agent_pb2.Event(ts_ms=t0, type="tap", keys=[1], values=[float("nan"), 0])],
                {},
                "event 0: value 'dwell_ms' is nan",
            ),
            ([agent_pb2.Event(ts_ms=t0 - 60_000, type="tap", keys=[1], values=[0, 0])], {}, "late"),
            ([agent_pb2.Event(ts_ms=-5, type="tap", keys=[1], values=[0, 0])], {}, "timestamp"),
            (
                [
                    agent_pb2.Event(
                        ts_ms=time.time_ns() // 1000, type="tap", keys=[1], values=[0, 0]
                    )
                ],
                {},
                "ahead of this device's clock",
            ),
            (
                [agent_pb2.Event(ts_ms=t0, type="tap", keys=[1, 2], values=[0, 0])],
                {},
                "event 0: 2 keys",
            ),
            (
                [good],
                {"key_fields": ["device"]},
                "key_fields must name the pipeline's fields ['user']",
            ),
            ([good], {"value_fields": ["amount", "amount"]}, "value_fields must name"),
            (
                [],
                {"columns": agent_pb2.EventColumns(ts_ms=[t0], types=["tap"], keys=[1])},
                "columns: 0 values for 1 events of 1 key and 2 value fields (2 expected)",
            ),
            (
                [good],
                {"columns": agent_pb2.EventColumns(ts_ms=[t0], types=["tap"], keys=[1])},
                "give events or columns, not both",
            ),
        ]:
            error = rpc_error(push, state, events, **fields)
            expected = grpc.StatusCode.OUT_OF_RANGE if fragment == "late" else INVALID
            assert error.code() == expected, error.details()
            assert fragment in error.details(), error.details()
        error = rpc_error(push, state, [good], model="nope")
        assert error.code() == grpc.StatusCode.NOT_FOUND
        assert "not installed" in error.details()
        # Columns may come in any order; the refused batches left no trace in the engine.
        late = [t0, t0 + 5]
        reply = push(
            state,
            [
                agent_pb2.Event(ts_ms=late[0], type="tap", keys=[3], values=[0.0, 200.0]),
                agent_pb2.Event(ts_ms=late[1], type="purchase", keys=[3], values=[50.0, 0.0]),
            ],
            value_fields=["amount", "dwell_ms"],
        )
        ours = local.push(
            np.array(late, dtype=np.int64),
            ["tap", "purchase"],
            np.array([[3], [3]], dtype=np.int64),
            np.array([[200.0, 0.0], [0.0, 50.0]]),
        )
        assert reply.firings == len(ours) == 1
        (last,) = sub.wait_for(fired + 1)[fired:]
        assert last.event_ts_ms == late[1] and last.key == 3
        # The same as columns (fields in any order here too).
        later = [t0 + 10, t0 + 15]
        columns = agent_pb2.EventColumns(
            ts_ms=later, types=["tap", "purchase"], keys=[4, 4], values=[0.0, 200.0, 50.0, 0.0]
        )
        reply = push(state, [], columns=columns, value_fields=["amount", "dwell_ms"])
        ours = local.push(
            np.array(later, dtype=np.int64),
            ["tap", "purchase"],
            np.array([[4], [4]], dtype=np.int64),
            np.array([[200.0, 0.0], [0.0, 50.0]]),
        )
        assert reply.accepted == 2 and reply.firings == len(ours) == 1
        (last,) = sub.wait_for(fired + 2)[fired + 1 :]
        assert last.event_ts_ms == later[1] and last.key == 4
        np.testing.assert_array_equal(
            to_array(last.outputs[0]),
            to_array(
                stub(state)
                .Infer(
                    agent_pb2.InferRequest(
                        model=MODEL, inputs=[to_tensor("x", ours[0].inputs["x"])]
                    ),
                    timeout=30,
                )
                .outputs[0]
            ),
        )
        fired += 1

        # Telemetry counts the firings.
        device = device_id(state)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            rows = [x for x in fleet_show(cp, device)["latency"] if x["version"] == version]
            if rows and rows[0]["pipeline_firings"] >= fired + 1:
                break
            time.sleep(0.5)
        assert rows and rows[0]["pipeline_firings"] == fired + 1, rows

        # A version without a pipeline: pushes are refused, the subscription stays open.
        rollout(cp, 2)
        wait_serving(state, 2, proc)
        error = rpc_error(push, state, [good])
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "v2 has no event pipeline" in error.details()
        assert sub.error is None
    finally:
        stderr = stop_daemon(proc)
    # Stopping ends the subscription cleanly, well within the drain.
    assert sub.stopped()
    assert "Traceback" not in stderr
