"""Hostile and careless apps against PushEvents' columns (EventColumns), on a local API
over a fake Serving (tests/device_agent/fake_local_api.py)."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest

from device_agent import pipelines
from device_agent.local_quotas import MAX_EVENTS, AppLimits
from device_agent.pipelines import Columns, EventsRejected
from protos import agent_pb2
from tests.device_agent.fake_local_api import (
    EXHAUSTED,
    INVALID,
    Reader,
    as_columns,
    ev,
    fake_locals,
    rpc_error,
)
from tests.device_agent.test_pipelines_unit import NOW, spec

I64 = np.iinfo(np.int64)


@pytest.fixture
def local(tmp_path):
    with fake_locals(tmp_path) as start:
        yield start


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
