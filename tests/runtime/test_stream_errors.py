"""Bad input: each case is a clear exception, and a rejected batch changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.stream import (
    BatchFormatError,
    EngineStateError,
    Feature,
    LateEventError,
    NonFiniteValueError,
    PatternError,
    StreamEngine,
    TimestampRangeError,
    UnknownEventTypeError,
    UnknownFieldError,
    Window,
    count,
    sliding,
)

from ._stream_helpers import assert_same_firings, batch


def make_engine() -> StreamEngine:
    engine = StreamEngine(
        event_types=["view", "click"],
        key_fields=["item", "page"],
        value_fields=["price"],
        lateness_ms=10,
    )
    engine.add_trigger(
        "view ~> click",
        by="item",
        features=[Feature("sum", "price", sliding(100)), Feature("count", window=count(5))],
    )
    return engine


GOOD = [(100, 0, [1, 1], [2.0]), (105, 1, [1, 1], [3.0])]


@pytest.mark.parametrize(
    ("row", "error", "message"),
    [
        (
            (100, 2, [1, 1], [1.0]),
            UnknownEventTypeError,
            "event 1: type code 2 is not one of the 2",
        ),
        ((100, -1, [1, 1], [1.0]), UnknownEventTypeError, "type code -1"),
        ((100, 1, [1, 1], [float("nan")]), NonFiniteValueError, "event 1: value 'price' is nan"),
        ((100, 1, [1, 1], [float("inf")]), NonFiniteValueError, "value 'price' is inf"),
        (
            (89, 1, [1, 1], [1.0]),
            LateEventError,
            "event 1: timestamp 89 is 17 ms behind the "
            "watermark 106, beyond the allowed lateness of 10 ms",
        ),
        ((-5, 1, [1, 1], [1.0]), TimestampRangeError, "event 1: timestamp -5 is outside"),
        (((1 << 62) + 1, 1, [1, 1], [1.0]), TimestampRangeError, "outside [0, 2**62]"),
    ],
)
def test_bad_event_rejects_the_whole_batch(row, error, message) -> None:
    engine, untouched = make_engine(), make_engine()
    engine.push_batch(*batch(GOOD, 2, 1))
    untouched.push_batch(*batch(GOOD, 2, 1))
    before = engine.stats()
    # The good event before the bad one must not be applied either.
    with pytest.raises(error, match=message.replace("[", r"\[").replace("*", r"\*")) as info:
        engine.push_batch(*batch([(106, 0, [1, 1], [5.0]), row], 2, 1))
    assert isinstance(info.value, ValueError)
    assert info.value.index == 1
    assert engine.stats() == before
    follow = batch([(107, 1, [1, 1], [7.0])], 2, 1)
    assert_same_firings(engine.push_batch(*follow), untouched.push_batch(*follow), 1)


def test_late_is_judged_against_earlier_events_of_the_same_batch() -> None:
    engine = make_engine()
    with pytest.raises(LateEventError, match="event 2: timestamp 10 is 990 ms behind"):
        engine.push_batch(
            *batch([(5, 0, [1, 1], [1.0]), (1000, 0, [1, 1], [1.0]), (10, 0, [1, 1], [1.0])], 2, 1)
        )
    assert engine.stats()["watermark"] is None


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"ts": np.array([1.0])}, "ts must have dtype int64, got float64"),
        ({"ts": [1]}, "ts must be a numpy array, got list"),
        ({"types": np.array([0], dtype=np.int64)}, "types must have dtype int32, got int64"),
        ({"types": np.array([[0]], dtype=np.int32)}, "types must be 1-D"),
        ({"keys": np.zeros((1, 3), dtype=np.int64)}, r"keys must have shape \(1, 2\)"),
        ({"keys": np.zeros(2, dtype=np.int64)}, "keys must be 2-D"),
        ({"values": np.zeros((1, 1), dtype=np.float32)}, "values must have dtype float64"),
        ({"values": np.zeros((2, 1))}, r"values must have shape \(1, 1\) for 1 events"),
    ],
)
def test_wrong_array_dtype_or_shape(arrays, message) -> None:
    engine = make_engine()
    good = dict(zip(("ts", "types", "keys", "values"), batch([GOOD[0]], 2, 1), strict=True))
    with pytest.raises(BatchFormatError, match=message):
        engine.push_batch(**{**good, **arrays})
    assert engine.stats()["events"] == 0


def test_native_binding_guards_layout_itself() -> None:
    """Called directly (bypassing the facade's checks), the binding still refuses."""
    engine = make_engine()
    ts, types, keys, values = batch([GOOD[0]], 2, 1)
    with pytest.raises(TypeError, match="values: wrong dtype"):
        engine._native.push_batch(ts, types, keys, values.astype(np.float32))


@pytest.mark.parametrize(
    ("pattern", "message"),
    [
        ("", "non-empty string"),
        ("view ->", "expected an event type, found end of pattern"),
        ("view -> -> click", "expected an event type, found '->'"),
        ("view click", "expected '->' or '~>' before 'click'"),
        ("scroll", "unknown event type 'scroll'"),
        ("view[price>]", "expected 'field <op> number'"),
        ("view[price=1]", "unexpected character '='"),
        ("view[price>1", "expected ',' or ']'"),
        ("view[color==1]", "unknown field 'color'"),
        ("view[item==1.5]", "key field 'item' compares with int64 literals"),
        ("view[item==99999999999999999999]", "int64 literals"),
        ("view[price>1e999]", "is not finite"),
        ("view & click", "unexpected character '&'"),
    ],
)
def test_malformed_pattern(pattern, message) -> None:
    engine = StreamEngine(
        event_types=["view", "click"], key_fields=["item"], value_fields=["price"]
    )
    with pytest.raises(PatternError, match=message):
        engine.add_trigger(pattern, by="item")
    assert engine.triggers == ()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"by": "user"}, PatternError, "partition key 'user' is not a key field"),
        ({"within_ms": -1}, PatternError, "within_ms must be in"),
        ({"features": [Feature("median", "price")]}, PatternError, "unknown aggregation"),
        ({"features": [Feature("count", "price")]}, PatternError, "count takes no field"),
        ({"features": [Feature("sum")]}, PatternError, "sum needs a value field"),
        ({"features": [Feature("sum", "price", of="scroll")]}, UnknownEventTypeError, "scroll"),
        ({"features": [Feature("histogram", "price", edges=(1, 1))]}, PatternError, "edges"),
        ({"features": [Feature("max", "price", edges=(1, 2))]}, PatternError, "only histogram"),
        ({"features": ["sum"]}, PatternError, "Feature instances"),
    ],
)
def test_bad_trigger_arguments(kwargs, error, message) -> None:
    engine = StreamEngine(event_types=["view"], key_fields=["item"], value_fields=["price"])
    with pytest.raises(error, match=message):
        engine.add_trigger("view", **{"by": "item", **kwargs})


def test_bad_windows_and_config() -> None:
    with pytest.raises(PatternError, match=r"sliding window size must be in \[1,"):
        sliding(0)
    with pytest.raises(PatternError, match="unknown window kind"):
        Window("hopping", 5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="duplicate event type names"):
        StreamEngine(event_types=["a", "a"])
    with pytest.raises(ValueError, match="lateness_ms must be an int"):
        StreamEngine(event_types=["a"], lateness_ms=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="key and value fields must have distinct names"):
        StreamEngine(event_types=["a"], key_fields=["x"], value_fields=["x"])


def test_removing_an_unknown_or_removed_trigger_is_refused() -> None:
    engine = make_engine()
    tid = engine.add_trigger("view", by="item")
    with pytest.raises(EngineStateError, match="no trigger 5"):
        engine.remove_trigger(5)
    engine.remove_trigger(tid)
    with pytest.raises(EngineStateError, match=f"trigger {tid} was already removed"):
        engine.remove_trigger(tid)
    assert engine.removed_triggers == {tid}


def test_single_push_checks_names_and_numbers() -> None:
    engine = make_engine()
    with pytest.raises(UnknownEventTypeError, match="unknown event type 'scroll'"):
        engine.push(1, "scroll", keys={"item": 1, "page": 1}, values={"price": 1.0})
    with pytest.raises(UnknownFieldError, match=r"unknown \['user'\], missing \['page'\]"):
        engine.push(1, "view", keys={"item": 1, "user": 1}, values={"price": 1.0})
    with pytest.raises(BatchFormatError, match="key field 'item' must be a number, got 1.5"):
        engine.push(1, "view", keys=[1.5, 1], values=[1.0])
    with pytest.raises(NonFiniteValueError, match="value 'price' is nan"):
        engine.push(1, "view", keys=[1, 1], values=[float("nan")])
    assert engine.stats()["events"] == 0
