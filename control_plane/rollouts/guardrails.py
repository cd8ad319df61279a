"""Halt rules: what they say, and how one is judged on a candidate and a baseline cohort.

A rule is `METRIC > THRESHOLD` (or `>=`), for example `p95_latency_ratio > 1.2` or
`crash_rate > 0.001`. Metrics:

    p50_latency_ratio, p95_latency_ratio, p99_latency_ratio
        the candidate's latency quantile over the baseline's
    crash_rate, error_rate, fallback_rate
        crashes, errors or backend fallbacks per inference, of the candidate
    crash_rate_ratio
        the candidate's crash rate over the baseline's
    install_failure_rate
        failed or rolled-back installs of the candidate version, per install outcome
    decode_tps_ratio (a language model; halts when it falls: `decode_tps_ratio < 0.9`)
        the candidate's decode tokens per second over the baseline's, at the median
        generation: the reciprocal of the decode-time-per-token p50 ratio, judged as it is
    ttft_p95_ratio (a language model)
        the candidate's p95 time to first token over the baseline's

The candidate cohort is the devices the rollout assigned its version, reporting it; the
baseline cohort is the devices it selects but does not include yet, reporting what they
are assigned without it; both by assignment, over the same window
(control_plane.rollouts.resolver.Snapshot.cohort_of). Each cohort holds every device's own rows.

Each rule ends in one of three verdicts:

- **insufficient**: a cohort it needs has fewer devices than `min_devices` (or 2k + 1,
  k = `outliers`) or fewer inferences than `min_inferences` once capped and trimmed (for
  install_failure_rate: fewer than `min_devices` install outcomes): neither passes nor
  fails;
- **fail**: even the figure most favourable to the candidate within the statistical margin
  breaks the rule. The figure is computed with each device capped at 4x the cohort's
  median device and the k devices pulling hardest each way left out
  (control_plane.telemetry.robust), so k devices can neither fail a healthy cohort nor
  pass a failing one; and it needs more than k (at least two) candidate devices that
  each show the problem. Rates use the Wilson score interval at `MARGIN_Z` standard
  errors (the candidate's lower bound, and for ratios the baseline's upper bound);
  latency quantiles use the distribution-free order-statistic interval (ranks
  q*n ± z*sqrt(n*q*(1-q))) and read the candidate at the lower edge of its bucket, the
  baseline at the upper edge. So a healthy rollout is not halted by noise or by histogram
  resolution. Latency is compared per backend config, like with like, on the configs
  each cohort ran on more than 2k devices (see `latency_ratio`);
- **pass** otherwise.

The margin treats inferences as independent draws. They are not quite (a slow device
gives many slow inferences); the cap keeps any device from weighing like many,
`min_devices` keeps either cohort from being a handful of devices, and slicing by device
class (`--slice-by soc`) compares like with like.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from contract import errors
from control_plane.store.rollup_aggregate import Aggregate, llm_figures
from control_plane.store.rollup_records import DeviceRollup
from control_plane.telemetry.design_effect import design_effects
from control_plane.telemetry.own_quantiles import device_ratio
from control_plane.telemetry.robust import (
    DEFAULT_OUTLIERS,
    Devices,
    left_out,
    quantile_weights,
    robust_rate,
)
from runtime.histogram import MIN_NS

MARGIN_Z = 3.0  # about 1 in 740 one-sided: checked every few seconds, so kept strict
MAX_RULES = 16
MAX_RULE_TEXT = 200
LATENCY_METRICS = {"p50_latency_ratio": 0.5, "p95_latency_ratio": 0.95, "p99_latency_ratio": 0.99}
RATE_METRICS = {"crash_rate": "crashes", "error_rate": "errors", "fallback_rate": "fallbacks"}
# A language model's: decode speed (its latency histogram is decode time per token) and
# time to first token (its second histogram).
LLM_METRICS = {"decode_tps_ratio": 0.5, "ttft_p95_ratio": 0.95}
METRICS = (
    *LATENCY_METRICS,
    *RATE_METRICS,
    "crash_rate_ratio",
    "install_failure_rate",
    *LLM_METRICS,
)
# Metrics that halt when they fall (the rest halt when they rise).
FALLING_METRICS = frozenset({"decode_tps_ratio"})
PASS, FAIL, INSUFFICIENT = "pass", "fail", "insufficient"
# Rules that need a baseline cohort (devices selected but not in the stage yet).
BASELINE_METRICS = frozenset({*LATENCY_METRICS, "crash_rate_ratio", *LLM_METRICS})

_TOKEN = re.compile(
    r"\s*(?:(?P<name>[A-Za-z_][A-Za-z0-9_]*)|(?P<op>>=|>|<=|<)|(?P<num>[0-9.eE+-]+))"
)


@dataclass(frozen=True)
class HaltRule:
    """One parsed rule."""

    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric}{self.op}{self.threshold!r}"  # repr: exactly what was given

    def breaks(self, value: float) -> bool:
        """Return whether `value` breaks the rule."""
        return {
            ">": value > self.threshold,
            ">=": value >= self.threshold,
            "<": value < self.threshold,
            "<=": value <= self.threshold,
        }[self.op]


def _refuse(text: str, pos: int, reason: str) -> errors.InvalidArgument:
    return errors.InvalidArgument(f"halt rule {text!r}: at position {pos + 1}: {reason}")


def parse_rule(text: str) -> HaltRule:
    """Parse `METRIC > NUMBER`; InvalidArgument gives the position and the reason."""
    if len(text) > MAX_RULE_TEXT:
        raise errors.InvalidArgument(f"halt rule longer than {MAX_RULE_TEXT} characters")
    pos = 0
    m = _TOKEN.match(text, pos)
    if m is None or m.group("name") is None:
        at = len(text) - len(text.lstrip())
        raise _refuse(text, at, f"expected a metric ({', '.join(METRICS)})")
    metric = m.group("name")
    if metric not in METRICS:
        raise _refuse(
            text, m.start("name"), f"unknown metric {metric!r} (use {', '.join(METRICS)})"
        )
    pos = m.end()
    m = _TOKEN.match(text, pos)
    falling = metric in FALLING_METRICS
    wanted = "'<' or '<='" if falling else "'>' or '>='"
    if m is None or m.group("op") is None:
        at = pos + len(text[pos:]) - len(text[pos:].lstrip())
        raise _refuse(text, at, f"expected {wanted} (rules say when to halt)")
    if m.group("op").startswith("<") != falling:
        raise _refuse(
            text,
            m.start("op"),
            f"{metric} halts when it {'falls' if falling else 'rises'}: use {wanted}",
        )
    op, pos = m.group("op"), m.end()
    m = _TOKEN.match(text, pos)
    at = pos + len(text[pos:]) - len(text[pos:].lstrip())
    if m is None or m.group("num") is None:
        raise _refuse(text, at, "expected a number")
    try:
        threshold = float(m.group("num"))
    except ValueError:
        raise _refuse(text, at, f"{m.group('num')!r} is not a number") from None
    if not math.isfinite(threshold) or threshold < 0:
        raise _refuse(text, at, "the threshold must be a finite number >= 0")
    threshold = abs(threshold)  # -0 is 0: one spelling, one rule
    if falling and threshold == 0:
        raise _refuse(text, at, f"{metric} is never below 0: such a rule could never halt")
    if metric.endswith("_rate") and threshold > 1:
        raise _refuse(text, at, f"{metric} is a fraction: the threshold must be at most 1")
    pos = m.end()
    if text[pos:].strip():
        rest = pos + len(text[pos:]) - len(text[pos:].lstrip())
        raise _refuse(text, rest, f"unexpected {text[rest:]!r} after the rule")
    return HaltRule(metric, op, threshold)


def parse_rules(texts: Sequence[str]) -> tuple[HaltRule, ...]:
    """Parse a rollout's rules (at most MAX_RULES, no repeats)."""
    if len(texts) > MAX_RULES:
        raise errors.InvalidArgument(f"at most {MAX_RULES} halt rules")
    rules = tuple(parse_rule(t) for t in texts)
    names = [str(r) for r in rules]
    if len(set(names)) != len(names):
        raise errors.InvalidArgument("a halt rule is given twice")
    return rules


@dataclass(frozen=True)
class Pooled:
    """Figures judged: a cohort's aggregate (capped and trimmed, or raw) and by config."""

    aggregate: Aggregate
    by_config: dict[str, Aggregate] = field(default_factory=dict)


class Cohort:
    """One cohort over the window: each device's own rows (control_plane.telemetry.robust)."""

    def __init__(self, members: Devices | Iterable[DeviceRollup] = ()) -> None:
        self.members = members if isinstance(members, Devices) else Devices.of(members)

    @property
    def devices(self) -> int:
        """Return how many devices reported in the cohort."""
        return len(self.members)

    @functools.cached_property
    def aggregate(self) -> Aggregate:
        """Return everything the cohort's devices reported, as reported (not capped)."""
        return self.members.pooled()

    def _llm_figures(self) -> dict:
        a = self.aggregate
        counts = {k: getattr(a, k) for k in ("tokens_in", "tokens_out", "cancellations")}
        return {**llm_figures(a), **counts}

    def ttft(self) -> Cohort:
        """Return the cohort with time to first token as its latency (a language model)."""
        return Cohort(self.members.ttft())

    def figures(self) -> dict:
        """Return the cohort's figures, JSON-able (evidence, CLI, dashboard)."""
        a = self.aggregate
        return {
            "devices": self.devices,
            "inferences": a.inferences,
            "errors": a.errors,
            "crashes": a.crashes,
            "fallbacks": a.fallbacks,
            "installs": a.installs,
            "install_failures": a.installs_failed + a.installs_rolled_back,
            "crash_signals": dict(sorted(a.crash_signals.items())),
            "devices_with": {
                kind: self.members.with_any(kind)
                for kind in ("crashes", "errors", "fallbacks", "install_failures")
            },
            **{f"p{p}_us": a.quantile_us(p / 100) for p in (50, 95, 99)},
            **(self._llm_figures() if a.ttft is not None or a.tokens_out else {}),
        }


@dataclass(frozen=True)
class Verdict:
    """A rule's outcome on one slice: the point figure, the bound judged, and why."""

    rule: str
    status: str
    value: float | None = None
    bound: float | None = None
    candidate: float | None = None
    baseline: float | None = None
    detail: str = ""
    sample: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """Return the verdict, JSON-able."""
        return {
            "rule": self.rule,
            "status": self.status,
            "value": self.value,
            "bound": self.bound,
            "candidate": self.candidate,
            "baseline": self.baseline,
            "detail": self.detail,
            "sample": self.sample,
        }


def wilson(successes: int, n: int, z: float = MARGIN_Z) -> tuple[float, float]:
    """Return the Wilson score interval of a proportion."""
    if n <= 0:
        return 0.0, 1.0
    p = min(1.0, successes / n)
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def _quantile_bounds(
    agg: Aggregate, q: float, deff: float = 1.0, z: float = MARGIN_Z
) -> tuple[float, float]:
    """Return (low, high) of the quantile's order-statistic interval, at bucket edges.

    The interval's ranks are those of n / `deff` independent draws (the design effect of
    samples clustered in devices: telemetry.design_effect), read as fractions of the whole.
    """
    n = agg.latency_count / max(deff, 1.0)
    spread = z * math.sqrt(n * q * (1 - q))
    low_q = max(1 / agg.latency_count, (q * n - spread) / n)
    high_q = min(1.0, (q * n + spread + 1) / n)
    return agg.quantile_us(low_q, "low"), agg.quantile_us(high_q, "high")


def judge(
    rule: HaltRule,
    candidate: Cohort,
    baseline: Cohort,
    *,
    min_devices: int,
    min_inferences: int,
    outliers: int = DEFAULT_OUTLIERS,
) -> Verdict:
    """Return the verdict of one rule on one slice's cohorts.

    Judged on each cohort capped and trimmed (`outliers` devices each way: see
    control_plane.telemetry.robust), so that many devices can neither fail a healthy
    cohort nor pass a failing one; a failing verdict also needs `max(2, outliers + 1)`
    candidate devices that each show the problem.
    """
    k = max(0, outliers)
    needed_devices = max(1, min_devices, 2 * k + 1)
    c, b = candidate.aggregate, baseline.aggregate
    sample: dict = {
        "candidate_devices": candidate.devices,
        "baseline_devices": baseline.devices,
        "candidate_inferences": c.inferences,
        "baseline_inferences": b.inferences,
    }
    name = str(rule)

    def short(who: str, cohort: Cohort, count: float, unit: str, needed: int) -> Verdict | None:
        if cohort.devices < needed_devices:
            why = f"{cohort.devices} of {needed_devices} devices needed"
            if needed_devices > max(1, min_devices):
                why += f" ({outliers} each way are left out)"
            return Verdict(name, INSUFFICIENT, detail=f"{who}: {why}", sample=sample)
        if count < max(1, needed):
            return Verdict(
                name,
                INSUFFICIENT,
                detail=f"{who}: {count:.0f} of {needed} {unit} needed",
                sample=sample,
            )
        return None

    if rule.metric == "install_failure_rate":
        failures, outcomes, weights = robust_rate(
            candidate.members, "install_failures", "install_outcomes", k
        )
        sample |= {"candidate_installs": c.installs, "left_out": _left_out(candidate, weights)}
        lacking = short("candidate", candidate, outcomes, "installs", min_devices)
        if lacking:
            return lacking
        value = failures / outcomes
        low, _ = wilson(failures, outcomes)
        verdict = _verdict(rule, name, value, low, value, None, sample)
        return _spread(verdict, candidate, "install_failures", k)
    if rule.metric in RATE_METRICS or rule.metric == "crash_rate_ratio":
        kind = RATE_METRICS.get(rule.metric, "crashes")
        events, n, weights = robust_rate(candidate.members, kind, "inferences", k)
        sample["left_out"] = _left_out(candidate, weights)
        lacking = short("candidate", candidate, n, "inferences", min_inferences)
        if lacking:
            return lacking
        if rule.metric in RATE_METRICS:
            value = events / n
            low, _ = wilson(events, n)
            return _spread(
                _verdict(rule, name, value, low, value, None, sample), candidate, kind, k
            )
        b_events, b_n, b_weights = robust_rate(baseline.members, "crashes", "inferences", k)
        sample["left_out"] |= _left_out(baseline, b_weights, "baseline")
        lacking = short("baseline", baseline, b_n, "inferences", min_inferences)
        if lacking:
            return lacking
        c_rate, b_rate = events / n, b_events / b_n
        c_low, _ = wilson(events, n)
        _, b_high = wilson(b_events, b_n)
        value = c_rate / b_rate if b_rate else (math.inf if c_rate else 1.0)
        verdict = _verdict(rule, name, value, c_low / b_high, c_rate, b_rate, sample)
        return _spread(verdict, candidate, "crashes", k)
    if rule.metric == "ttft_p95_ratio":
        candidate, baseline = candidate.ttft(), baseline.ttft()
        unit = "first tokens"
    else:
        unit = "timed generations" if rule.metric == "decode_tps_ratio" else "inferences"
    q = LATENCY_METRICS.get(rule.metric) or LLM_METRICS[rule.metric]
    invert = rule.metric in FALLING_METRICS
    (c_weights, b_weights), configs = quantile_weights([candidate.members, baseline.members], q, k)
    sample["left_out"] = _left_out(candidate, c_weights) | _left_out(
        baseline, b_weights, "baseline"
    )
    judged_c = Pooled(*candidate.members.pooled_all(c_weights))
    judged_b = Pooled(*baseline.members.pooled_all(b_weights))
    for who, cohort, judged in (
        ("candidate", candidate, judged_c),
        ("baseline", baseline, judged_b),
    ):
        lacking = short(who, cohort, judged.aggregate.latency_count, unit, min_inferences)
        if lacking:
            return lacking
    # Both cohorts' margins widened by how much the baseline's devices differ among
    # themselves (healthy by assumption; the candidate's spread could be the regression),
    # each by its own samples per device; robust to k liars on every config it reads.
    deff = design_effects(
        candidate.members, c_weights, baseline.members, b_weights, configs or [None], k
    )
    sample["design_effect"] = {
        str(c): {"candidate": round(dc, 2), "baseline": round(db, 2)}
        for c, (dc, db) in deff.items()
    }
    value, bound = latency_ratio(judged_c, judged_b, q, configs, deff)
    figures = (value, bound, judged_c.aggregate.quantile_us(q), judged_b.aggregate.quantile_us(q))
    # Two readings, each robust to k devices; the one the evidence weighs more decides.
    # All inferences pooled catches a tail a few devices make (3 of 30 slower: p99);
    # each device's own quantile, compared over devices, catches a slowdown every device
    # shows however few they are and however they differ (the pooled margin, widened by
    # the design effect, is then very wide).
    per_device = device_ratio(candidate.members, baseline.members, q, k)
    how = "of all inferences"
    if per_device is not None:
        d = per_device
        own_bound = math.exp(d.log_ratio - MARGIN_Z * d.standard_error)
        if own_bound > bound:
            how = "of each device's own"
            figures = (math.exp(d.log_ratio), own_bound, d.candidate_us, d.baseline_us)
            sample["left_out"] = d.left_out
    # A falling metric (tokens per second) is the reciprocal of the latency ratio judged:
    # its bound is the reciprocal of the latency bound most favourable to the candidate.
    reading = _tokens_per_s if invert else (lambda x: x)
    verdict = _verdict(
        rule,
        name,
        *(reading(x) for x in figures[:2]),
        *(_us_to_tps(x) if invert else x for x in figures[2:]),
        sample,
    )
    head = f"{rule.metric} {reading(figures[0]):.4g}"
    if not invert:
        said = f"{how} p{round(q * 100)}"
    elif how == "of all inferences":
        said = "of all generations, median"
    else:
        said = f"{how} median generation"
    detail = verdict.detail.replace(head, f"{head} ({said})", 1)
    verdict = replace(verdict, detail=detail)
    if verdict.status != FAIL:
        return verdict
    if how == "of all inferences":
        seen = sum(
            rule.breaks(reading(latency_ratio(_own(candidate, i), judged_b, q, configs)[0]))
            for i in range(candidate.devices)
        )
    else:
        seen = sum(rule.breaks(reading(math.exp(x))) for x in per_device.slower.values())
    return _spread(verdict, candidate, "", k, seen=seen, what="is that much slower")


def _tokens_per_s(latency_ratio: float) -> float:
    """Return the tokens-per-second ratio of a time-per-token ratio."""
    return 1 / latency_ratio if latency_ratio > 0 else math.inf


def _us_to_tps(us: float | None) -> float | None:
    """Return tokens per second of a time per token in microseconds."""
    return 1e6 / us if us else None


def _own(cohort: Cohort, position: int) -> Pooled:
    """Return one device's own figures (uncapped) as a Pooled."""
    mine = cohort.members.device(position)
    return Pooled(mine.pooled(), mine.by_config())


def _left_out(cohort: Cohort, weights, who: str = "candidate") -> dict:
    gone = left_out(cohort.members, weights)
    return {who: gone} if gone else {}


def latency_ratio(
    candidate: Pooled,
    baseline: Pooled,
    q: float,
    configs: Sequence[str] | None = None,
    deff: Mapping[str | None, tuple[float, float]] | None = None,
) -> tuple[float, float]:
    """Return the candidate/baseline ratio of quantile `q`, and its margin-side bound.

    Compared per backend config in `configs` (by default every config both cohorts ran;
    `judge` passes those each ran on more than 2k devices), then combined as a weighted
    geometric mean with weights n_c * n_b / (n_c + n_b) (a config thin in either cohort
    counts little). Backends differ twice over in speed, and which devices happen to be
    on the new version is a draw: pooled, a candidate with more CPU-only devices than the
    baseline looked 1.4x slower on p95 with nothing wrong. A version that moves devices
    to a slower backend does so by falling back, which `fallback_rate` watches. Cohorts
    with no config to compare are compared pooled. `deff` widens each config's margins
    (None: pooled) by the design effects of samples clustered in devices (the candidate's,
    the baseline's).
    """
    wanted = set(candidate.by_config) if configs is None else set(configs)
    deff = deff or {}
    pairs = [
        (agg, baseline.by_config[config], deff.get(config, (1.0, 1.0)))
        for config, agg in sorted(candidate.by_config.items())
        if config in wanted
        and agg.latency_count
        and baseline.by_config.get(config, Aggregate()).latency_count
    ] or [(candidate.aggregate, baseline.aggregate, deff.get(None, (1.0, 1.0)))]
    # Below 1 µs the histogram cannot tell latencies apart: compare from 1 µs up.
    floor = MIN_NS / 1000
    log_value = log_bound = total = 0.0
    for c, b, (c_effect, b_effect) in pairs:
        if not (c.latency_count and b.latency_count):
            continue
        c_low, _ = _quantile_bounds(c, q, c_effect)
        _, b_high = _quantile_bounds(b, q, b_effect)
        n_c, n_b = c.latency_count, b.latency_count
        weight = n_c * n_b / (n_c + n_b)
        log_value += weight * math.log(max(c.quantile_us(q), floor) / max(b.quantile_us(q), floor))
        log_bound += weight * math.log(max(c_low, floor) / max(b_high, floor))
        total += weight
    if not total:
        return 1.0, 1.0
    return math.exp(log_value / total), math.exp(log_bound / total)


MIN_AFFECTED = 2


def _spread(
    verdict: Verdict,
    cohort: Cohort,
    kind: str,
    outliers: int,
    *,
    seen: int | None = None,
    what: str = "",
) -> Verdict:
    """Pass a failing verdict that too few devices show: a few devices cannot halt a rollout.

    Counts come from devices, and a faulty or hostile device can report any number of
    crashes or errors, or any latency; a regression is something several devices see:
    at least MIN_AFFECTED, and more than the `outliers` any verdict must withstand.
    """
    if verdict.status != FAIL:
        return verdict
    if seen is None:
        seen = cohort.members.with_any(kind)
        what = f"reports {kind.replace('_', ' ')}"
    needed = max(MIN_AFFECTED, outliers + 1)
    if seen >= needed:
        return verdict
    return replace(
        verdict,
        status=PASS,
        detail=f"{verdict.detail}, but only {seen} device {what} (a regression needs {needed})",
    )


def _verdict(rule, name, value, bound, candidate, baseline, sample) -> Verdict:
    failed = rule.breaks(bound)
    least = "at most" if rule.op.startswith("<") else "at least"
    detail = (
        f"{rule.metric} {value:.4g}, {least} {bound:.4g} within the margin: "
        + ("breaks" if failed else "keeps")
        + f" {rule.op} {rule.threshold:g}"
    )
    return Verdict(
        name,
        FAIL if failed else PASS,
        value=_finite(value),
        bound=_finite(bound),
        candidate=candidate,
        baseline=baseline,
        detail=detail,
        sample=sample,
    )


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None
