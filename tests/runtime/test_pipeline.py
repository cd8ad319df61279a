"""Pipeline specs: strict parsing, fitting a model's input, and turning events into inputs."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from control_plane.demo.sample_pipeline import activity_events, activity_pipeline
from runtime.pipeline import Pipeline, PipelineError, parse_pipeline
from runtime.stream import StreamEngine
from runtime.stream_spec import LateEventError, UnknownEventTypeError

X16 = [{"name": "x", "shape": [1, 16], "dtype": "float32"}]


def small(**trigger) -> dict:
    """A one-trigger spec over events a/b, key k, value v; `trigger` overrides its fields."""
    t = {
        "name": "t",
        "pattern": "a -> b[v > 1]",
        "by": "k",
        "input": "x",
        "features": [
            {"agg": "mean", "field": "v", "window": {"count": 3}, "of": "a"},
            {"agg": "count", "window": {"sliding_ms": 100}},
        ],
    }
    t.update(trigger)
    return {"event_types": ["a", "b"], "key_fields": ["k"], "value_fields": ["v"], "triggers": [t]}


def test_the_sample_spec_round_trips_and_fits_the_sample_model():
    spec = parse_pipeline(activity_pipeline())
    again = parse_pipeline(json.dumps(spec.to_json()))
    assert again.canonical() == spec.canonical()
    (fit,) = spec.fit(X16).values()
    assert (fit.name, fit.shape, fit.dtype) == ("x", (1, 16), "float32")
    # A dynamic batch dimension is taken as one firing.
    (fit,) = spec.fit([{"name": "x", "shape": [-1, 16], "dtype": "float32"}]).values()
    assert fit.shape == (1, 16)


BAD_SPECS = [
    ("not json", "{", "not JSON"),
    ("not an object", [], "pipeline: expected an object"),
    ("unknown key", {**small(), "extra": 1}, "unknown key(s) ['extra']"),
    ("no triggers", {"event_types": ["a"]}, "missing ['triggers']"),
    ("empty triggers", {**small(), "triggers": []}, "1..64 triggers"),
    ("bad type name", {**small(), "event_types": ["a b"]}, "'a b' is not an identifier"),
    ("duplicate types", {**small(), "event_types": ["a", "a"]}, "duplicate event type"),
    ("unknown type", small(pattern="a -> c"), "unknown event type 'c'"),
    ("bad pattern", small(pattern="a ->"), "expected an event type"),
    ("unknown field", small(pattern="a[w > 1]"), "unknown field 'w'"),
    ("bad by", small(by="v"), "partition key 'v' is not a key field"),
    ("string lateness", {**small(), "lateness_ms": "5"}, "lateness_ms: expected an integer"),
    ("bool lateness", {**small(), "lateness_ms": True}, "lateness_ms: expected an integer"),
    ("negative within", small(within_ms=-1), "within_ms must be in"),
    ("no features", small(features=[]), "1..256 features"),
    (
        "unknown agg",
        small(features=[{"agg": "median", "field": "v", "window": {"count": 2}}]),
        "features[0].agg: 'median' is not one of",
    ),
    (
        "two windows",
        small(features=[{"agg": "count", "window": {"count": 2, "sliding_ms": 5}}]),
        "features[0].window: expected one of",
    ),
    (
        "zero window",
        small(features=[{"agg": "count", "window": {"count": 0}}]),
        "count window size must be in [1,",
    ),
    (
        "feature of unknown type",
        small(features=[{"agg": "count", "window": {"count": 2}, "of": "z"}]),
        "of='z' is not an event type",
    ),
    (
        "histogram edges unsorted",
        small(
            features=[{"agg": "histogram", "field": "v", "window": {"count": 2}, "edges": [2, 1]}]
        ),
        "strictly increasing",
    ),
    ("duplicate trigger", {**small(), "triggers": small()["triggers"] * 2}, "duplicate trigger"),
    ("bad trigger name", small(name="no spaces"), "'no spaces' is not a valid name"),
    ("nan missing", small(missing=float("nan")), "missing: expected a finite number"),
    ("bad shape", small(shape=[1, 0]), "shape: expected positive ints"),
    ("huge missing", small(missing=10**400), "missing: expected a finite number"),
    (
        "huge edge",
        small(
            features=[
                {"agg": "histogram", "field": "v", "window": {"count": 2}, "edges": [0, 10**400]}
            ]
        ),
        "edges: expected a finite number",
    ),
    (
        "float window",
        small(features=[{"agg": "count", "window": {"count": 3.0}}]),
        "triggers[0] (t).features[0].window: expected an integer, got 3.0",
    ),
    ("too many keys", {**small(), "max_keys": 2**31}, "max_keys: at most 1000000"),
    (
        "huge count window",
        small(features=[{"agg": "count", "window": {"count": 1 << 17}}]),
        "a count count window holds at most 65536 events",
    ),
    (
        "huge distinct window",
        small(features=[{"agg": "distinct", "field": "v", "window": {"count": 5000}}]),
        "a distinct count window holds at most 4096 events",
    ),
]


@pytest.mark.parametrize(
    ("doc", "fragment"), [b[1:] for b in BAD_SPECS], ids=[b[0] for b in BAD_SPECS]
)
def test_a_bad_spec_is_refused_naming_the_problem(doc, fragment):
    with pytest.raises(PipelineError) as caught:
        parse_pipeline(doc)
    assert fragment in str(caught.value)


def test_an_oversized_or_deeply_nested_spec_is_refused():
    with pytest.raises(PipelineError, match="over 65536 bytes"):
        parse_pipeline(json.dumps({"event_types": ["a" * 70_000]}))
    with pytest.raises(PipelineError, match="not JSON"):
        parse_pipeline("[" * 30_000 + "]" * 30_000)


FIT_ERRORS = [
    ("two inputs", [X16[0], {"name": "h", "shape": [1, 2], "dtype": "float32"}], "exactly one"),
    (
        "other name",
        [{"name": "y", "shape": [1, 2], "dtype": "float32"}],
        "not the model's input 'y'",
    ),
    ("int input", [{"name": "x", "shape": [1, 2], "dtype": "int64"}], "is int64"),
    ("half input", [{"name": "x", "shape": [1, 2], "dtype": "float16"}], "is float16"),
    ("too wide", [{"name": "x", "shape": [1, 16], "dtype": "float32"}], "give 2 value(s)"),
    ("dynamic", [{"name": "x", "shape": [1, -1], "dtype": "float32"}], "give the per-firing"),
]


@pytest.mark.parametrize(
    ("inputs", "fragment"), [f[1:] for f in FIT_ERRORS], ids=[f[0] for f in FIT_ERRORS]
)
def test_a_spec_that_does_not_fit_the_model_says_why(inputs, fragment):
    with pytest.raises(PipelineError) as caught:
        parse_pipeline(small()).fit(inputs)
    assert fragment in str(caught.value)


def test_a_missing_value_must_fit_the_input_dtype():
    with pytest.raises(PipelineError, match="missing: 1e\\+39 does not fit float32"):
        parse_pipeline(small(missing=1e39)).fit(
            [{"name": "x", "shape": [1, 2], "dtype": "float32"}]
        )
    parse_pipeline(small(missing=1e39)).fit([{"name": "x", "shape": [1, 2], "dtype": "float64"}])


def test_an_explicit_shape_fills_a_dynamic_input_and_must_match_fixed_dims():
    dynamic = [{"name": "x", "shape": [-1, 1, -1], "dtype": "float64"}]
    (fit,) = parse_pipeline(small(shape=[1, 1, 2])).fit(dynamic).values()
    assert fit.shape == (1, 1, 2)
    with pytest.raises(PipelineError, match="does not fit the input's declared shape"):
        parse_pipeline(small(shape=[1, 2, 1])).fit(dynamic)
    with pytest.raises(PipelineError, match="takes 4"):
        parse_pipeline(small(shape=[1, 1, 4])).fit(dynamic)


def test_firings_fill_the_input_in_feature_order_with_missing_for_empty_windows():
    spec = parse_pipeline(small(missing=-7.5))
    pipeline = Pipeline(spec, spec.fit([{"name": "x", "shape": [1, 2], "dtype": "float32"}]))
    ts = np.array([10, 20, 30, 40], dtype=np.int64)
    keys = np.array([[1], [1], [2], [2]], dtype=np.int64)
    values = np.array([[4.0], [5.0], [0.0], [9.0]])
    # key 1: a(4) -> b(5) fires; key 2: "b" first, no "a" before it: no firing.
    (firing,) = pipeline.push(ts, ["a", "b", "b", "b"], keys, values)
    assert (firing.trigger, firing.key, firing.ts) == ("t", 1, 20)
    np.testing.assert_array_equal(firing.inputs["x"], np.array([[4.0, 2.0]], dtype=np.float32))
    assert firing.inputs["x"].dtype == np.float32
    # a key whose "a" window is empty: the mean is NaN, so `missing` fills it
    spec = parse_pipeline(small(pattern="b", missing=-7.5))
    pipeline = Pipeline(spec, spec.fit([{"name": "x", "shape": [2], "dtype": "float64"}]))
    (firing,) = pipeline.push(ts[:1], ["b"], keys[:1], np.array([[2.0]]))
    np.testing.assert_array_equal(firing.inputs["x"], [-7.5, 1.0])


def test_the_sample_pipeline_agrees_with_the_stream_engine_it_wraps():
    doc = activity_pipeline()
    spec = parse_pipeline(doc)
    pipeline = Pipeline(spec, spec.fit(X16))
    engine = StreamEngine(
        event_types=doc["event_types"],
        key_fields=doc["key_fields"],
        value_fields=doc["value_fields"],
        lateness_ms=doc["lateness_ms"],
    )
    t = spec.triggers[0]
    engine.add_trigger(t.pattern, by=t.by, features=t.features, within_ms=t.within_ms)
    ts, types, keys, values = activity_events(3000, users=20)
    firings = pipeline.push(ts, types, keys, values)
    codes = np.array([doc["event_types"].index(x) for x in types], dtype=np.int32)
    expected = engine.push_batch(ts, codes, keys, values)
    assert len(firings) == len(expected) > 50
    rows = np.nan_to_num(expected.features(0), nan=0.0).astype(np.float32)
    got = np.concatenate([f.inputs["x"] for f in firings])
    np.testing.assert_array_equal(got, rows)
    assert [f.key for f in firings] == expected.key.tolist()


def test_a_bad_batch_is_refused_whole_and_state_carries_over_between_equal_specs():
    spec = parse_pipeline(small())
    fits = spec.fit([{"name": "x", "shape": [1, 2], "dtype": "float32"}])
    old = Pipeline(spec, fits)
    one = np.array([[1]], dtype=np.int64)
    old.push(np.array([10], dtype=np.int64), ["a"], one, np.array([[3.0]]))
    with pytest.raises(UnknownEventTypeError, match="event 1: type 'zz'"):
        old.push(
            np.array([11, 12], dtype=np.int64), ["b", "zz"], np.repeat(one, 2, 0), np.ones((2, 1))
        )
    # The refused batch left nothing behind, and an equal spec takes the partial match.
    new = Pipeline(parse_pipeline(copy.deepcopy(small())), fits)
    assert new.carry_over(old)
    (firing,) = new.push(np.array([20], dtype=np.int64), ["b"], one, np.array([[5.0]]))
    np.testing.assert_array_equal(firing.inputs["x"], [[3.0, 2.0]])
    with pytest.raises(LateEventError):
        new.push(np.array([0], dtype=np.int64), ["a"], one, np.array([[1.0]]))
    other = Pipeline(parse_pipeline(small(pattern="a ~> b")), fits)
    assert not other.carry_over(new)
