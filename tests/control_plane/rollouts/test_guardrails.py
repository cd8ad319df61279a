"""Halt rules: parsing (position and reason), and verdicts that halt real regressions and
leave noise alone."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane import errors
from control_plane.rollouts.guardrails import (
    FAIL,
    INSUFFICIENT,
    PASS,
    Cohort,
    HaltRule,
    judge,
    parse_rule,
    parse_rules,
    wilson,
)
from control_plane.store.rollups import INT64_MAX, Aggregate, saturating_add
from control_plane.store.telemetry import ModelStatsRecord
from runtime.histogram import LatencyHistogram


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("p95_latency_ratio>1.2", HaltRule("p95_latency_ratio", ">", 1.2)),
        ("  crash_rate > 0.001 ", HaltRule("crash_rate", ">", 0.001)),
        ("error_rate>=1e-3", HaltRule("error_rate", ">=", 0.001)),
        ("install_failure_rate>0.05", HaltRule("install_failure_rate", ">", 0.05)),
    ],
)
def test_rules_parse(text, rule):
    assert parse_rule(text) == rule
    assert parse_rule(str(rule)) == rule  # what is stored parses back the same


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("", "at position 1: expected a metric"),
        ("p95_latency>1.2", "at position 1: unknown metric 'p95_latency'"),
        ("p95_latency_ratio 1.2", "at position 19: expected '>' or '>='"),
        ("p95_latency_ratio<1.2", "at position 18: expected '>' or '>='"),
        ("p95_latency_ratio>>1.2", "at position 19: expected a number"),
        ("p95_latency_ratio>", "at position 19: expected a number"),
        ("crash_rate>1..2", "at position 12: '1..2' is not a number"),
        ("crash_rate>nan", "at position 12: expected a number"),
        ("crash_rate>1e999", "at position 12: the threshold must be a finite number"),
        ("crash_rate>2", "crash_rate is a fraction"),
        ("crash_rate>0.1 or x", "at position 16: unexpected 'or x'"),
        ("crash_rate>٣", "at position 12: expected a number"),  # no Arabic-Indic digits
    ],
)
def test_a_malformed_rule_is_refused_with_its_position(text, fragment):
    with pytest.raises(errors.InvalidArgument) as caught:
        parse_rule(text)
    assert fragment in str(caught.value)


def test_rules_are_bounded_and_not_repeated():
    with pytest.raises(errors.InvalidArgument, match="twice"):
        parse_rules(["crash_rate>0.1", "crash_rate > 0.1"])
    with pytest.raises(errors.InvalidArgument, match="at most 16"):
        parse_rules([f"crash_rate>0.{i}" for i in range(17)])


def cohort(devices, latencies_us=(), *, inferences=None, crashes=0, seed=0, **counts) -> Cohort:
    agg = Aggregate()
    h = LatencyHistogram()
    if len(latencies_us):
        h.record_many_ns(np.asarray(latencies_us, dtype=np.float64) * 1000)
    crash = {"at": "x", "config": "c", "reason": "signal", "signal": "SIGSEGV"}
    n = inferences if inferences is not None else len(latencies_us)
    agg.add_stats(
        ModelStatsRecord("m", 1, "fp32", "c", n, 0, 0, h.to_dict(), crashes=(crash,) * crashes)
    )
    for name, value in counts.items():
        setattr(agg, name, value)
    return Cohort(agg, devices)


def lognormal(n, median_us, seed):
    return np.random.default_rng(seed).lognormal(np.log(median_us), 0.4, n)


P95 = parse_rule("p95_latency_ratio>1.2")


GPU, CPU = "OPENCL/low/t4/mem-normal", "CPU/normal/t4/mem-normal"


def by_config(devices, parts: dict) -> Cohort:
    """A cohort whose devices ran several backend configs (latencies per config)."""
    split = {config: cohort(1, latencies).aggregate for config, latencies in parts.items()}
    total = Aggregate()
    for agg in split.values():
        total.merge(agg)
    return Cohort(total, devices, {}, split)


def test_latency_is_compared_per_backend_config_like_with_like():
    # GPU devices run 2.5x faster than CPU ones, and the candidate happened to get mostly
    # CPU devices: pooled, it looks 1.7x slower on p95 with nothing wrong with it.
    candidate = by_config(50, {GPU: lognormal(400, 400, 1), CPU: lognormal(3600, 1000, 2)})
    baseline = by_config(50, {GPU: lognormal(3600, 400, 3), CPU: lognormal(400, 1000, 4)})
    limits = {"min_devices": 20, "min_inferences": 500}
    pooled = judge(P95, Cohort(candidate.aggregate, 50), Cohort(baseline.aggregate, 50), **limits)
    assert pooled.status == FAIL and pooled.value > 1.5  # what comparing pooled concluded
    fair = judge(P95, candidate, baseline, **limits)
    assert fair.status == PASS and 0.9 < fair.value < 1.1, fair
    # 2x slower on every backend is a regression whatever the mix.
    slow = by_config(50, {GPU: lognormal(400, 800, 5), CPU: lognormal(3600, 2000, 6)})
    assert judge(P95, slow, baseline, **limits).status == FAIL
    # Nothing in common to compare like with like: pooled, as before.
    other = by_config(50, {"CPU/normal/t1/mem-normal": lognormal(4000, 3000, 7)})
    moved = judge(P95, other, baseline, **limits)
    assert moved.status == FAIL and moved.value > 2


def test_the_same_distribution_never_halts():
    # Twenty draws of two cohorts from one distribution: noise alone never fails the rule.
    for seed in range(20):
        a = cohort(50, lognormal(2000, 1000, seed))
        b = cohort(50, lognormal(2000, 1000, seed + 100))
        v = judge(P95, a, b, min_devices=20, min_inferences=500)
        assert v.status == PASS, v


def test_a_slowdown_halts_with_its_figures():
    slow = cohort(50, lognormal(5000, 1500, 1))
    base = cohort(50, lognormal(5000, 1000, 2))
    v = judge(P95, slow, base, min_devices=20, min_inferences=500)
    assert v.status == FAIL
    assert v.value == pytest.approx(1.5, rel=0.1) and 1.2 < v.bound <= v.value
    assert v.candidate > v.baseline and v.sample["candidate_devices"] == 50


def test_a_small_slowdown_within_the_margin_passes():
    # 25% slower on 40 samples: the point ratio breaks 1.2, the margin does not.
    slow = cohort(30, lognormal(40, 1250, 3))
    base = cohort(30, lognormal(40, 1000, 4))
    v = judge(P95, slow, base, min_devices=20, min_inferences=20)
    assert v.value > 1.2 and v.status == PASS


def test_too_small_a_sample_neither_passes_nor_fails():
    slow, base = cohort(5, lognormal(5000, 9000, 1)), cohort(50, lognormal(5000, 1000, 2))
    v = judge(P95, slow, base, min_devices=20, min_inferences=500)
    assert v.status == INSUFFICIENT and "candidate: 5 of 20 devices" in v.detail
    v = judge(P95, base, cohort(50), min_devices=20, min_inferences=500)
    assert v.status == INSUFFICIENT and "baseline: 0 of 500 inferences" in v.detail


def test_rates_use_the_lower_bound_of_their_interval():
    rule = parse_rule("crash_rate>0.001")
    base = cohort(50, inferences=100_000)
    # 3 crashes in 1000 inferences: 0.3% measured, but it could well be under 0.1%.
    few = judge(rule, cohort(50, inferences=1000, crashes=3), base, min_devices=1, min_inferences=1)
    assert few.status == PASS and few.value == pytest.approx(0.003)
    # 300 in 100,000: the same rate, now beyond doubt.
    many = judge(
        rule, cohort(50, inferences=100_000, crashes=300), base, min_devices=1, min_inferences=1
    )
    assert many.status == FAIL and many.bound > 0.001
    ratio = parse_rule("crash_rate_ratio>2")
    worse = judge(
        ratio,
        cohort(50, inferences=100_000, crashes=300),
        cohort(50, inferences=100_000, crashes=30),
        min_devices=1,
        min_inferences=1,
    )
    assert worse.status == FAIL and worse.value == pytest.approx(10)
    none = judge(ratio, cohort(50, inferences=10), base, min_devices=1, min_inferences=1)
    assert none.status == PASS  # no crashes on either side: nothing to divide


def test_install_failures_count_installs_not_inferences():
    rule = parse_rule("install_failure_rate>0.05")
    c = cohort(60, installs_activated=40, installs_failed=15, installs_rolled_back=5)
    v = judge(rule, c, cohort(0), min_devices=50, min_inferences=10**9)
    assert v.status == FAIL and v.value == pytest.approx(20 / 60)
    c = cohort(60, installs_activated=10)
    v = judge(rule, c, cohort(0), min_devices=50, min_inferences=1)
    assert v.status == INSUFFICIENT and "10 of 50 installs" in v.detail


def test_wilson_bounds():
    low, high = wilson(0, 1000)
    assert low == 0 and 0 < high < 0.01
    low, high = wilson(500, 1000)
    assert low < 0.5 < high


def test_counts_stick_at_the_largest_int64_instead_of_wrapping():
    a = np.array([INT64_MAX - 1, 5], np.int64)
    b = np.array([10, 5], np.int64)
    assert saturating_add(a, b).tolist() == [INT64_MAX, 10]


def test_histogram_buckets_added_from_a_report_stick_at_the_largest_int64():
    from control_plane.store.telemetry import ModelStatsRecord
    from runtime.histogram import SCHEME

    latency = {
        "scheme": SCHEME,
        "count": 3,
        "sum_ns": 30_000,
        "min_ns": 9_000,
        "max_ns": 11_000,
        "buckets": [[5, 2], [7, 1]],
    }
    stats = ModelStatsRecord("det", 1, "fp32", "CPU", 3, 0, 0, latency)
    agg = Aggregate()
    agg.buckets[5] = INT64_MAX - 1
    agg.add_stats(stats)
    agg.add_stats(stats)
    assert agg.buckets[[5, 7]].tolist() == [INT64_MAX, 2] and agg.latency_count == 6
    other = Aggregate()
    other.add_stats(stats)
    assert other.buckets.sum() == 3  # each aggregate owns its buckets


def test_one_device_alone_cannot_fail_a_rate_rule():
    rule = parse_rule("crash_rate>0.001")
    base = cohort(50, inferences=100_000)
    storm = cohort(50, inferences=100_000, crashes=300)
    one = Cohort(storm.aggregate, 50, {"crashes": 1})
    v = judge(rule, one, base, min_devices=1, min_inferences=1)
    assert v.status == PASS and "only 1 device reports crashes" in v.detail
    many = Cohort(storm.aggregate, 50, {"crashes": 7})
    assert judge(rule, many, base, min_devices=1, min_inferences=1).status == FAIL


def test_sub_microsecond_latencies_never_halt():
    # Below 1 µs the histogram cannot tell latencies apart: no ratio to judge there.
    zeros = cohort(50, np.zeros(2000))
    assert judge(P95, zeros, zeros, min_devices=1, min_inferences=1).status == PASS
    fast = cohort(50, np.full(2000, 0.99))
    faster = cohort(50, np.full(2000, 1.08))
    v = judge(P95, faster, fast, min_devices=1, min_inferences=1)
    assert v.status == PASS and v.value < 1.2


def test_a_rule_is_stored_exactly_as_given():
    assert str(parse_rule("p95_latency_ratio>1.0000001")) == "p95_latency_ratio>1.0000001"
    assert parse_rule(str(parse_rule("crash_rate>1e-3"))).threshold == 0.001


@pytest.mark.parametrize(
    ("metric", "count"), [("error_rate", "errors"), ("fallback_rate", "fallbacks")]
)
def test_error_and_fallback_rates_halt_on_their_own_counts(metric, count):
    rule = parse_rule(f"{metric}>0.01")
    base = cohort(50, inferences=100_000)
    spread = {count: 50}  # how many devices showed it: a regression, not one device
    bad = cohort(50, inferences=100_000, **{count: 3000})
    bad = Cohort(bad.aggregate, bad.devices, spread)
    v = judge(rule, bad, base, min_devices=20, min_inferences=1000)
    assert v.status == FAIL and v.value == pytest.approx(0.03) and v.bound > 0.01
    fine = Cohort(cohort(50, inferences=100_000, **{count: 500}).aggregate, 50, spread)
    assert judge(rule, fine, base, min_devices=20, min_inferences=1000).status == PASS
    # The other incidents do not count towards this rule.
    other = "fallbacks" if count == "errors" else "errors"
    noisy = Cohort(cohort(50, inferences=100_000, **{other: 9000}).aggregate, 50, {other: 50})
    assert judge(rule, noisy, base, min_devices=20, min_inferences=1000).status == PASS


@pytest.mark.parametrize("quantile", [50, 99])
def test_p50_and_p99_ratios_judge_their_own_quantile(quantile):
    rule = parse_rule(f"p{quantile}_latency_ratio>1.2")
    base = cohort(50, lognormal(20_000, 1000, 1))
    # Only the slowest 2% got 3x slower: p99 moves, the median does not.
    rng = np.random.default_rng(2)
    tail = lognormal(20_000, 1000, 3)
    slowest = tail > np.quantile(tail, 0.98)
    tail[slowest] *= 3
    v = judge(rule, cohort(50, tail), base, min_devices=20, min_inferences=1000)
    assert v.status == (FAIL if quantile == 99 else PASS), v
    # Everything 1.5x slower: both fail, each on its own quantile's figures.
    slow = cohort(50, lognormal(20_000, 1500, int(rng.integers(100))))
    v = judge(rule, slow, base, min_devices=20, min_inferences=1000)
    assert v.status == FAIL and v.value == pytest.approx(1.5, rel=0.08)
    assert v.candidate == pytest.approx(slow.aggregate.quantile_us(quantile / 100))
    assert v.baseline == pytest.approx(base.aggregate.quantile_us(quantile / 100))
