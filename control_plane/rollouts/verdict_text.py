"""A guardrail verdict as people read it: one sentence, the figures kept for scripts.

    p95 latency is 1.04x the baseline's; a halt needs it above 1.5x with 99.87%
    confidence: pass

The confidence is the true one of the margin a rule fails on (`MARGIN_Z` standard errors,
one-sided: Φ(3) = 99.87%), not a round figure. The CLI's `rollout show` and the dashboard
print this sentence; `--json` and the API keep `value`, `bound` and `detail` beside it.
"""

from __future__ import annotations

from statistics import NormalDist

from contract import errors
from control_plane.rollouts.guardrails import (
    FAIL,
    INSUFFICIENT,
    LATENCY_METRICS,
    MARGIN_Z,
    HaltRule,
    Verdict,
    parse_rule,
)

CONFIDENCE = NormalDist().cdf(MARGIN_Z)
_SUBJECTS = {
    "crash_rate": "the crash rate",
    "error_rate": "the error rate",
    "fallback_rate": "the fallback rate",
    "install_failure_rate": "the install failure rate",
    "crash_rate_ratio": "the crash rate",
    "decode_tps_ratio": "decode speed (tokens/s, median generation)",
    "ttft_p95_ratio": "p95 time to first token",
}


def confidence_text() -> str:
    """Return the margin's one-sided confidence, as "99.87%"."""
    return f"{CONFIDENCE * 100:.2f}%"


def verdict_sentence(verdict: Verdict) -> str:
    """Say a verdict in one sentence ending in its status (pass, fail or insufficient)."""
    try:
        rule = parse_rule(verdict.rule)
    except errors.InvalidArgument:  # stored before a rule's spelling changed: say it raw
        return f"{verdict.detail}: {verdict.status}"
    subject = _subject(rule, verdict.detail)
    if verdict.status == INSUFFICIENT or verdict.value is None and verdict.bound is None:
        return f"{subject}: not judged yet ({verdict.detail}): {verdict.status}"
    value, bound = _figure(rule, verdict.value), _figure(rule, verdict.bound)
    falling = rule.op.startswith("<")
    side = {">": "above", ">=": "at or above", "<": "below", "<=": "at or below"}[rule.op]
    limit = f"{side} {_threshold(rule)}"
    least, could = ("at most", "high") if falling else ("at least", "low")
    sure = f"with {confidence_text()} confidence"
    if verdict.status == FAIL:
        return f"{subject} is {value}; {sure} it is {least} {bound}, {limit}: fail"
    bound_breaks = verdict.bound is None or rule.breaks(verdict.bound)
    if bound_breaks:  # passed only because too few devices show it
        _, _, few = verdict.detail.partition(", but ")
        return f"{subject} is {value}, {limit} {sure} ({least} {bound}), but {few}: pass"
    if verdict.value is None or rule.breaks(verdict.value):
        return (
            f"{subject} is {value}, {limit}, but not {sure}: it may be as {could} as {bound}: pass"
        )
    return f"{subject} is {value}; a halt needs it {limit} {sure}: pass"


def _subject(rule: HaltRule, detail: str) -> str:
    if rule.metric in LATENCY_METRICS:
        q = rule.metric.split("_", 1)[0]
        if "of each device's own" in detail:
            return f"{q} latency (each device's own)"
        return f"{q} latency"
    subject = _SUBJECTS.get(rule.metric, rule.metric)
    if "of each device's own" in detail:
        return f"{subject} (each device's own)"
    return subject


def _is_ratio(rule: HaltRule) -> bool:
    return rule.metric in LATENCY_METRICS or rule.metric.endswith("_ratio")


def _figure(rule: HaltRule, x: float | None) -> str:
    if x is None:  # not finite: a baseline with none of what the candidate has
        return "unbounded (the baseline has none)" if _is_ratio(rule) else "unbounded"
    if _is_ratio(rule):
        return f"{x:.3g}x the baseline's"
    per = "installs" if rule.metric == "install_failure_rate" else "inferences"
    return f"{_percent(x)} of {per}"


def _threshold(rule: HaltRule) -> str:
    if _is_ratio(rule):
        return f"{rule.threshold:g}x"
    return _percent(rule.threshold)


def _percent(x: float) -> str:
    return f"{x * 100:.3g}%"
