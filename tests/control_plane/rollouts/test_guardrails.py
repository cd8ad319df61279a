"""Halt rules: parsing (position and reason), and verdicts that halt real regressions and
leave noise alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from contract import errors
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
from control_plane.store.report_records import ModelStatsRecord
from control_plane.store.rollup_aggregate import INT64_MAX, Aggregate, saturating_add
from control_plane.store.rollup_records import EPOCH, DeviceKey, DeviceRollup
from control_plane.telemetry.robust import Devices, _compact, device_quantiles, min_samples
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
        ("p95_latency_ratio<1.2", "at position 18: p95_latency_ratio halts when it rises"),
        ("decode_tps_ratio>0.9", "at position 17: decode_tps_ratio halts when it falls: use '<'"),
        ("decode_tps_ratio 0.9", "at position 18: expected '<' or '<='"),
        ("decode_tps_ratio<0", "at position 18: decode_tps_ratio is never below 0"),
        ("decode_tps_ratio<=-0", "never below 0: such a rule could never halt"),
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


def test_minus_zero_is_zero_so_a_rule_is_not_repeated_under_another_spelling():
    assert str(parse_rule("p95_latency_ratio>-0")) == "p95_latency_ratio>0.0"
    with pytest.raises(errors.InvalidArgument, match="given twice"):
        parse_rules(["crash_rate>0", "crash_rate>-0"])


def test_rules_are_bounded_and_not_repeated():
    with pytest.raises(errors.InvalidArgument, match="twice"):
        parse_rules(["crash_rate>0.1", "crash_rate > 0.1"])
    with pytest.raises(errors.InvalidArgument, match="at most 16"):
        parse_rules([f"crash_rate>0.{i}" for i in range(17)])


def device_row(device: str, latencies_us=(), *, config="c", inferences=None, crashes=0, **counts):
    """One device's row in a cohort: its latencies, inferences, crashes and counters."""
    agg = Aggregate()
    h = LatencyHistogram()
    if len(latencies_us):
        h.record_many_ns(np.asarray(latencies_us, dtype=np.float64) * 1000)
    crash = {"at": "x", "config": config, "reason": "signal", "signal": "SIGSEGV"}
    n = inferences if inferences is not None else len(latencies_us)
    agg.add_stats(
        ModelStatsRecord("m", 1, "fp32", config, n, 0, 0, h.to_dict(), crashes=(crash,) * crashes)
    )
    for name, value in counts.items():
        setattr(agg, name, value)
    key = DeviceKey("ro_1", EPOCH, "candidate", "m", 1, "fp32", config, device)
    return DeviceRollup.of(key, agg)


def _share(total: int, parts: int, i: int) -> int:
    return total // parts + (i < total % parts)


def cohort(
    devices, latencies_us=(), *, inferences=None, crashes=0, spread=None, prefix="d", **counts
) -> Cohort:
    """`devices` devices sharing the samples, inferences and counts evenly; crashes and
    counts go to the first `spread` devices only (default: every one)."""
    latencies = np.asarray(latencies_us, dtype=np.float64)
    n = inferences if inferences is not None else len(latencies)
    shown = spread or devices
    rows = []
    for i in range(devices):
        mine = latencies[i::devices]
        extra = {k: _share(v, shown, i) if i < shown else 0 for k, v in counts.items()}
        rows.append(
            device_row(
                f"dev_{prefix}{i:04d}",
                mine,
                inferences=max(_share(n, devices, i), len(mine)),
                crashes=_share(crashes, shown, i) if i < shown else 0,
                **extra,
            )
        )
    return Cohort(rows)


def plus(base: Cohort, *rows) -> Cohort:
    """The cohort with more devices' rows."""
    return Cohort([*base.members.rows, *rows])


def lognormal(n, median_us, seed):
    return np.random.default_rng(seed).lognormal(np.log(median_us), 0.4, n)


P95 = parse_rule("p95_latency_ratio>1.2")


GPU, CPU = "OPENCL/low/t4/mem-normal", "CPU/normal/t4/mem-normal"


def by_config(devices, parts: dict, prefix="d") -> Cohort:
    """A cohort whose devices each ran one of several backend configs."""
    rows = []
    per_config = max(1, devices // len(parts))
    for c, (config, latencies) in enumerate(parts.items()):
        latencies = np.asarray(latencies)
        for i in range(per_config):
            name = f"dev_{prefix}{c}x{i:03d}"
            rows.append(device_row(name, latencies[i::per_config], config=config))
    return Cohort(rows)


def pooled(c: Cohort) -> Cohort:
    """The same devices as if they had all run one config."""
    return Cohort(
        DeviceRollup.of(dataclasses.replace(r.key, config="c"), r.aggregate())
        for r in c.members.rows
    )


def test_latency_is_compared_per_backend_config_like_with_like():
    # GPU devices run 2.5x faster than CPU ones, and the candidate happened to get mostly
    # CPU devices: pooled, it looks 1.7x slower on p95 with nothing wrong with it.
    candidate = by_config(50, {GPU: lognormal(400, 400, 1), CPU: lognormal(3600, 1000, 2)})
    baseline = by_config(50, {GPU: lognormal(3600, 400, 3), CPU: lognormal(400, 1000, 4)})
    limits = {"min_devices": 20, "min_inferences": 500}
    mixed = judge(P95, pooled(candidate), pooled(baseline), **limits)
    assert mixed.status == FAIL and mixed.value > 1.5  # what comparing pooled concludes
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
    # 30% slower on 40 samples: the point ratio breaks 1.2, the margin does not.
    slow = cohort(30, lognormal(40, 1300, 3))
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
    # Nobody left out (outliers=0): the margin alone.
    rule = parse_rule("crash_rate>0.001")
    base = cohort(50, inferences=100_000)
    # 3 crashes in 1000 inferences: 0.3% measured, but it could well be under 0.1%.
    few = judge(
        rule,
        cohort(50, inferences=1000, crashes=3),
        base,
        min_devices=1,
        min_inferences=1,
        outliers=0,
    )
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
        outliers=0,
    )
    assert worse.status == FAIL and worse.value == pytest.approx(10)
    none = judge(
        ratio, cohort(50, inferences=10), base, min_devices=1, min_inferences=1, outliers=0
    )
    assert none.status == PASS  # no crashes on either side: nothing to divide


def test_install_failures_count_installs_not_inferences():
    rule = parse_rule("install_failure_rate>0.05")
    c = cohort(60, installs_activated=40, installs_failed=15, installs_rolled_back=5)
    v = judge(rule, c, cohort(0), min_devices=50, min_inferences=10**9)
    assert v.status == FAIL and v.value == pytest.approx(20 / 60, rel=0.05)  # 2 left out
    c = cohort(60, installs_activated=10)
    v = judge(rule, c, cohort(0), min_devices=50, min_inferences=1)
    assert v.status == INSUFFICIENT and "8 of 50 installs" in v.detail  # 2 left out


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
    from control_plane.store.report_records import ModelStatsRecord
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
    one = cohort(50, inferences=100_000, crashes=300, spread=1)
    v = judge(rule, one, base, min_devices=1, min_inferences=1)
    assert v.status == PASS and "left_out" in v.sample
    many = cohort(50, inferences=100_000, crashes=300, spread=7)
    assert judge(rule, many, base, min_devices=1, min_inferences=1).status == FAIL
    # Without leaving anyone out, one device's crashes still need a second device.
    v = judge(rule, one, base, min_devices=1, min_inferences=1, outliers=0)
    assert v.status == PASS and "only 1 device reports crashes" in v.detail


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
    # Every device shows it: a regression, not one device.
    bad = cohort(50, inferences=100_000, **{count: 3000})
    v = judge(rule, bad, base, min_devices=20, min_inferences=1000)
    assert v.status == FAIL and v.value == pytest.approx(0.03) and v.bound > 0.01
    fine = cohort(50, inferences=100_000, **{count: 500})
    assert judge(rule, fine, base, min_devices=20, min_inferences=1000).status == PASS
    # The other incidents do not count towards this rule.
    other = "fallbacks" if count == "errors" else "errors"
    noisy = cohort(50, inferences=100_000, **{other: 9000})
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
    # The figures of the reading that decided (all inferences, or each device's own).
    assert v.candidate / v.baseline == pytest.approx(v.value)
    assert v.candidate > slow.aggregate.quantile_us(quantile / 100) / 2


# -- one device (or k) cannot decide a verdict ----------------------------------------------


def healthy(n=30, per_device=400, median_us=2000, seed=0, prefix="d") -> Cohort:
    return cohort(n, lognormal(n * per_device, median_us, seed), prefix=prefix)


def test_one_device_reporting_huge_slow_samples_cannot_halt_a_healthy_rollout():
    """The attack review's first reproduction, as a verdict: one candidate device sends
    100,000 samples at 5 s; the other 30 are as fast as the baseline."""
    liar = device_row("dev_liar", np.full(100_000, 5e6))
    candidate, baseline = plus(healthy(seed=1), liar), healthy(seed=2, prefix="b")
    v = judge(P95, candidate, baseline, min_devices=3, min_inferences=1000)
    assert v.status == PASS and v.value < 1.2, v
    assert "dev_liar" in v.sample["left_out"]["candidate"]
    # Nobody left out: capped (it weighs what 4 devices do) it still breaks the rule, and
    # only the second line of defence holds: a regression needs two devices showing it.
    capped_only = judge(P95, candidate, baseline, min_devices=3, min_inferences=1000, outliers=0)
    assert capped_only.status == PASS and capped_only.value > 100
    assert "only 1 device is that much slower" in capped_only.detail
    # A liar in the baseline reporting everything fast cannot make the candidate look slow.
    fast = device_row("dev_fast", np.full(100_000, 1.0))
    v = judge(P95, healthy(seed=1), plus(baseline, fast), min_devices=3, min_inferences=1000)
    assert v.status == PASS, v


def test_one_device_reporting_millions_of_good_inferences_cannot_hide_a_regression():
    """The second reproduction: every candidate device crashes 5% of the time and runs 3x
    slower; one device sends 120 M fast, crash-free inferences."""
    base = healthy(seed=3, prefix="b")
    broken = cohort(30, lognormal(12_000, 6000, 4), crashes=600)  # 5% of 12,000
    liar = device_row("dev_liar", np.full(3_000_000, 50.0), inferences=120_000_000)
    crash = parse_rule("crash_rate>0.01")
    for rule in (P95, crash):
        v = judge(rule, plus(broken, liar), base, min_devices=3, min_inferences=1000)
        assert v.status == FAIL, v
        assert "dev_liar" in v.sample["left_out"]["candidate"]
    # A baseline liar reporting everything slow cannot make the candidate look fast.
    slow = device_row("dev_slow", np.full(100_000, 5e6))
    v = judge(P95, broken, plus(base, slow), min_devices=3, min_inferences=1000)
    assert v.status == FAIL, v


def test_a_real_regression_on_3_of_30_devices_still_halts():
    base = healthy(per_device=2000, seed=5, prefix="b")
    rows = list(healthy(n=27, per_device=2000, seed=6).members.rows)
    rng = np.random.default_rng(7)
    crashing = [
        device_row(f"dev_bad{i}", rng.lognormal(np.log(6000), 0.4, 2000), crashes=200)
        for i in range(3)
    ]  # 3x slower and 10% crashes, on 3 devices of 30
    # Their 10% of the samples is the slowest tail: p99 sees it (p95, once the slowest of
    # them is left out, sits at the tail's edge).
    p99 = parse_rule("p99_latency_ratio>1.5")
    v = judge(p99, Cohort([*rows, *crashing]), base, min_devices=3, min_inferences=1000)
    assert v.status == FAIL and v.value > 1.5, v
    crash = parse_rule("crash_rate>0.001")
    v = judge(crash, Cohort([*rows, *crashing]), base, min_devices=3, min_inferences=1000)
    assert v.status == FAIL, v
    # Two of them are not enough once one is left out: it takes more than k to halt.
    v = judge(crash, Cohort([*rows, *crashing[:1]]), base, min_devices=3, min_inferences=1000)
    assert v.status == PASS, v


def test_k_colluding_devices_are_withstood_when_the_setting_says_k():
    liars = [device_row(f"dev_liar{i}", np.full(100_000, 5e6)) for i in range(2)]
    candidate, baseline = plus(healthy(seed=8), *liars), healthy(seed=9, prefix="b")
    limits = {"min_devices": 3, "min_inferences": 1000}
    assert judge(P95, candidate, baseline, **limits, outliers=1).status == FAIL
    v = judge(P95, candidate, baseline, **limits, outliers=2)
    assert v.status == PASS and set(v.sample["left_out"]["candidate"]) >= {"dev_liar0", "dev_liar1"}


def test_a_cohort_of_2k_devices_or_fewer_is_insufficient():
    small = healthy(n=2)
    v = judge(P95, small, healthy(seed=3, prefix="b"), min_devices=1, min_inferences=1)
    assert v.status == INSUFFICIENT and "2 of 3 devices needed" in v.detail
    v = judge(
        P95, healthy(n=4), healthy(seed=3, prefix="b"), min_devices=1, min_inferences=1, outliers=2
    )
    assert v.status == INSUFFICIENT and "4 of 5 devices needed" in v.detail


def test_one_device_cannot_satisfy_the_minimum_sample_alone():
    """min_inferences counts what is judged: a device with a million samples among two
    with ten is capped, so the cohort does not have the 10,000 it needs."""
    rows = [device_row(f"dev_s{i}", lognormal(10, 1000, i)) for i in range(4)]
    rows.append(device_row("dev_big", lognormal(1_000_000, 1000, 9)))
    v = judge(P95, Cohort(rows), healthy(seed=3, prefix="b"), min_devices=1, min_inferences=10_000)
    assert v.status == INSUFFICIENT and "inferences needed" in v.detail


def test_device_quantiles_are_each_devices_own_nearest_rank_quantile():
    # Devices on two configs, some with too few samples for a p99; asked twice (the health
    # view does), the answer is the same arrays.
    rng = np.random.default_rng(7)
    rows = [
        device_row(
            f"dev_q{i:03d}",
            rng.lognormal(np.log(300 * (1 + i % 5)), 0.6, 20 + 7 * i),
            config=config,
        )
        for i in range(40)
        for config in ((GPU,) if i % 3 else (GPU, CPU))
    ]
    devices = Devices.of(rows)
    for q in (0.5, 0.95, 0.99):
        for config in (None, GPU, CPU):
            got = device_quantiles(devices, q, config)
            assert device_quantiles(devices, q, config) is got
            for position, log_us in zip(got.positions, got.log_us, strict=True):
                mine = devices.device(position)
                own = mine.pooled(None, config)
                assert own.latency_count >= min_samples(q)
                assert log_us == pytest.approx(np.log(max(own.quantile_us(q), 1e-3)), abs=1e-9)
            wanted = {
                p
                for p in range(len(devices))
                if devices.device(p).pooled(None, config).latency_count >= min_samples(q)
            }
            assert set(got.positions.tolist()) == wanted


@pytest.mark.parametrize(("size", "codes"), [(0, 60), (1, 60), (7, 60), (500, 60), (5, 10**6)])
def test_rows_are_grouped_by_code_as_a_sort_would(size, codes):
    codes = np.random.default_rng(size).integers(0, codes, size)
    values, inverse = _compact(codes)
    expected_values, expected_inverse = np.unique(codes, return_inverse=True)
    assert values.tolist() == expected_values.tolist()
    assert inverse.tolist() == expected_inverse.tolist()
