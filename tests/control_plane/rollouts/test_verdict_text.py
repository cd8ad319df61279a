"""A guardrail verdict as one sentence (the CLI's `rollout show` and the dashboard)."""

from __future__ import annotations

import pytest

from control_plane.rollouts.guardrails import Verdict
from control_plane.rollouts.verdict_text import confidence_text, verdict_sentence


def test_the_confidence_is_the_margins_own():
    assert confidence_text() == "99.87%"  # MARGIN_Z = 3, one-sided


@pytest.mark.parametrize(
    ("verdict", "sentence"),
    [
        (
            Verdict("p95_latency_ratio>1.5", "pass", value=1.04, bound=0.98),
            "p95 latency is 1.04x the baseline's; a halt needs it above 1.5x with 99.87% "
            "confidence: pass",
        ),
        (
            Verdict("p95_latency_ratio>1.5", "fail", value=2.1, bound=1.8),
            "p95 latency is 2.1x the baseline's; with 99.87% confidence it is at least 1.8x "
            "the baseline's, above 1.5x: fail",
        ),
        (
            Verdict("p95_latency_ratio>1.5", "pass", value=1.7, bound=1.3),
            "p95 latency is 1.7x the baseline's, above 1.5x, but not with 99.87% confidence: "
            "it may be as low as 1.3x the baseline's: pass",
        ),
        (
            Verdict(
                "crash_rate>0.001",
                "pass",
                value=0.002,
                bound=0.0015,
                detail="crash_rate 0.002, at least 0.0015 within the margin: breaks > 0.001, "
                "but only 1 device reports crashes (a regression needs 3)",
            ),
            "the crash rate is 0.2% of inferences, above 0.1% with 99.87% confidence (at least "
            "0.15% of inferences), but only 1 device reports crashes (a regression needs 3): "
            "pass",
        ),
        (
            Verdict("error_rate>0.01", "pass", value=0.0, bound=0.0),
            "the error rate is 0% of inferences; a halt needs it above 1% with 99.87% "
            "confidence: pass",
        ),
        (
            Verdict("crash_rate>0.001", "insufficient", detail="candidate: 3 of 50 devices needed"),
            "the crash rate: not judged yet (candidate: 3 of 50 devices needed): insufficient",
        ),
    ],
)
def test_verdicts_read_as_sentences(verdict, sentence):
    assert verdict_sentence(verdict) == sentence


def test_a_rule_stored_in_an_older_spelling_is_said_raw():
    old = Verdict("p95>>1.2", "pass", detail="p95 1.0, at least 0.9 within the margin: keeps")
    assert verdict_sentence(old) == "p95 1.0, at least 0.9 within the margin: keeps: pass"


def test_rollout_show_prints_the_sentence_and_json_keeps_the_figures():
    from control_plane.cli.fleet_views import rollout_dict, rollout_text
    from protos import fleet_pb2

    r = fleet_pb2.Rollout(id="ro_1", model="m", version=2, stages=[10, 100], stage=1)
    said = verdict_sentence(Verdict("p95_latency_ratio>1.5", "pass", value=1.04, bound=0.98))
    r.health.overall.rules.add(
        rule="p95_latency_ratio>1.5", status="pass", value=1.04, bound=0.98, sentence=said
    )
    assert "p95_latency_ratio>1.5" in rollout_text(r) and said in rollout_text(r)
    (rule,) = rollout_dict(r)["health"]["overall"]["rules"]
    assert (rule["value"], rule["bound"], rule["sentence"]) == (1.04, 0.98, said)
