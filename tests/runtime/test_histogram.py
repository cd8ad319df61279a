"""Mergeable latency histograms: exact merges, bounded quantile error, lossless telemetry."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.histogram import MAX_RELATIVE_ERROR, LatencyHistogram

# 1 ns .. 200 s: covers the underflow bucket, the log range and the overflow bucket.
latencies = st.lists(st.integers(min_value=0, max_value=200_000_000_000), max_size=200)
in_range = st.lists(st.integers(min_value=1_000, max_value=100_000_000_000), min_size=1)


def hist(samples: list[int]) -> LatencyHistogram:
    h = LatencyHistogram()
    for ns in samples:
        h.record_ns(ns)
    return h


@given(latencies, latencies)
def test_merge_equals_histogram_of_concatenated_samples(a, b):
    merged = hist(a).merge(hist(b))
    assert merged == hist(a + b)
    assert merged.count == len(a) + len(b)
    assert merged.sum_ns == sum(a) + sum(b)


@given(latencies, latencies, latencies)
def test_merge_is_associative_and_commutative(a, b, c):
    x, y, z = hist(a), hist(b), hist(c)
    assert (x + y) + z == x + (y + z) == z + y + x


@settings(max_examples=200)
@given(in_range, st.sampled_from([0.01, 0.5, 0.9, 0.95, 0.99, 1.0]))
def test_quantile_within_the_documented_relative_error(samples, q):
    exact = sorted(samples)[max(1, math.ceil(q * len(samples))) - 1] / 1000
    got = hist(samples).quantile(q)
    assert abs(got - exact) <= exact * (MAX_RELATIVE_ERROR + 1e-9)
    assert MAX_RELATIVE_ERROR < 0.045


@given(latencies)
def test_dict_round_trip_is_lossless_and_json_able(samples):
    h = hist(samples)
    d = json.loads(json.dumps(h.to_dict()))
    assert LatencyHistogram.from_dict(d) == h


def test_percentiles_of_a_known_distribution():
    h = hist([1_000 * i for i in range(1, 101)])  # 1..100 µs
    p = h.percentiles()
    assert p["p50_us"] == pytest.approx(50, rel=MAX_RELATIVE_ERROR)
    assert p["p99_us"] == pytest.approx(99, rel=MAX_RELATIVE_ERROR)
    assert h.mean_us == pytest.approx(50.5)


def test_empty_histogram_has_no_quantiles():
    h = LatencyHistogram()
    assert h.quantile(0.5) is None and h.mean_us is None
    assert h.merge(hist([5_000])).quantile(0.5) == pytest.approx(5, rel=MAX_RELATIVE_ERROR)


def test_copy_with_reset_starts_a_new_interval():
    h = hist([1_000, 2_000])
    interval = h.copy(reset=True)
    assert interval.count == 2 and h.count == 0 and h.quantile(0.5) is None


def test_from_dict_refuses_foreign_or_inconsistent_data():
    d = hist([1_000]).to_dict()
    with pytest.raises(ValueError, match="scheme"):
        LatencyHistogram.from_dict({**d, "scheme": "linear"})
    with pytest.raises(ValueError, match="add up"):
        LatencyHistogram.from_dict({**d, "count": 2})
    with pytest.raises(ValueError, match="bucket"):
        LatencyHistogram.from_dict({**d, "buckets": [[10_000, 1]]})
    with pytest.raises(ValueError):
        hist([1]).quantile(0)


def test_recording_many_at_once_equals_recording_each():
    import numpy as np

    rng = np.random.default_rng(5)
    samples = np.concatenate(
        [rng.lognormal(13, 2, 5000).astype(np.int64), np.array([0, 1, 999, 1000, 10**15])]
    )
    one_by_one, at_once = LatencyHistogram(), LatencyHistogram()
    for ns in samples.tolist():
        one_by_one.record_ns(ns)
    at_once.record_many_ns(samples[:100])
    at_once.record_many_ns(samples[100:])
    at_once.record_many_ns(np.array([], dtype=np.int64))
    assert at_once == one_by_one


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_recording_many_refuses_what_is_not_finite_and_records_nothing(bad):
    import numpy as np

    h, expected = LatencyHistogram(), LatencyHistogram()
    h.record_many_ns(np.array([1000.0, 2500.5]))  # floats: truncated to whole ns
    expected.record_ns(1000)
    expected.record_ns(2500)
    with pytest.raises(ValueError, match="finite"):
        h.record_many_ns(np.array([5000.0, bad, 7000.0]))
    assert h == expected
