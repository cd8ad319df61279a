"""A language model's rollout judged on its tokens: decode speed and time to first token,
through real rollups (SQLite and PostgreSQL), as the agent and the simulator report them."""

from __future__ import annotations

import dataclasses
import datetime as dt

import numpy as np
import pytest

from control_plane.rollouts.guard import Guard
from control_plane.rollouts.guardrails import parse_rule
from control_plane.rollouts.verdict_text import verdict_sentence
from control_plane.store.report_records import ModelStatsRecord
from control_plane.store.sql_store import SqlStore
from control_plane.telemetry.roller import Roller
from runtime.histogram import LatencyHistogram
from tests.control_plane.telemetry.test_rollups import (
    CLASS,
    NOW,
    FixedResolver,
    released,
    report,
    rollout,
    split,
)

LLM = "CPU/low/t4/mem-low"
RULES = ("decode_tps_ratio<0.9", "ttft_p95_ratio>1.2")


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


def generations(version, rng, *, tps, ttft_ms, n=300) -> ModelStatsRecord:
    """`n` generations at about `tps` decode tokens/s and `ttft_ms` to the first token."""
    decode, first = LatencyHistogram(), LatencyHistogram()
    decode.record_many_ns(rng.lognormal(np.log(1e9 / tps), 0.1, n))
    first.record_many_ns(rng.lognormal(np.log(ttft_ms * 1e6), 0.1, n))
    return ModelStatsRecord(
        "det",
        version,
        "fp32",
        LLM,
        inferences=n,
        errors=0,
        pipeline_firings=0,
        latency=decode.to_dict(),
        ttft=first.to_dict(),
        tokens_in=40 * n,
        tokens_out=64 * n,
        cancellations=2,
    )


def _health(store, *, decode_x=1.0, ttft_x=1.0):
    record = dataclasses.replace(
        rollout(), stages=(50.0, 100.0), halt_rules=RULES, min_devices=5, min_inferences=500
    )
    rng = np.random.default_rng(0)
    candidates, baseline = split(store, record, n=8, soc="sm8450")
    for i, d in enumerate(candidates):
        slow = generations(2, rng, tps=60 * decode_x, ttft_ms=200 * ttft_x)
        report(store, d, f"batch-c-{i:03d}", slow)
    for i, d in enumerate(baseline):
        report(store, d, f"batch-b-{i:03d}", generations(1, rng, tps=60, ttft_ms=200))
    clock = lambda: NOW + dt.timedelta(seconds=1)  # noqa: E731
    resolver = FixedResolver(released(), record)
    Roller(store, resolver, CLASS, clock=clock, straggler_age=dt.timedelta(0)).roll()
    return Guard(store, None, CLASS, clock=clock).health(record).overall


def test_a_slower_decode_and_first_token_fail_their_rules_with_the_figures(store):
    overall = _health(store, decode_x=0.6, ttft_x=1.6)
    decode, ttft = overall.verdicts
    assert decode.status == "fail" and ttft.status == "fail", (decode, ttft)
    assert decode.value == pytest.approx(0.6, rel=0.05) and decode.bound < 0.9
    assert decode.candidate == pytest.approx(36, rel=0.05)  # tokens/s, median generation
    assert decode.baseline == pytest.approx(60, rel=0.05)
    assert ttft.value == pytest.approx(1.6, rel=0.1) and ttft.bound > 1.2
    sentence = verdict_sentence(decode)
    assert sentence.startswith("decode speed (tokens/s, median generation)")
    assert "it is at most" in sentence and "below 0.9x: fail" in sentence
    figures = overall.candidate.figures()
    assert figures["decode_tps"] == pytest.approx(36, rel=0.05)
    assert figures["ttft_p95_ms"] == pytest.approx(320 * np.exp(1.645 * 0.1), rel=0.1)
    assert (figures["tokens_out"], figures["cancellations"]) == (8 * 64 * 300, 16)


def test_the_same_speed_passes(store):
    decode, ttft = _health(store).verdicts
    assert (decode.status, ttft.status) == ("pass", "pass"), (decode.detail, ttft.detail)
    assert decode.value == pytest.approx(1.0, rel=0.05)


def test_a_faster_version_never_halts_on_tokens(store):
    decode, ttft = _health(store, decode_x=1.5, ttft_x=0.7).verdicts
    assert (decode.status, ttft.status) == ("pass", "pass")


@pytest.mark.parametrize(
    ("text", "broken"),
    [
        ("decode_tps_ratio<0.9", [0.89, 0.5]),
        ("decode_tps_ratio<=0.9", [0.9]),
        ("ttft_p95_ratio>1.2", [1.21]),
    ],
)
def test_token_rules_break_the_way_they_read(text, broken):
    rule = parse_rule(text)
    assert all(rule.breaks(x) for x in broken)
    assert not rule.breaks(1.0)
