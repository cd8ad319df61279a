"""Teacher-forced agreement figures: exact on known cases, stable on extreme logits."""

from __future__ import annotations

import math

import numpy as np
import pytest

from runtime.llm.scoring import log_softmax, score


def test_identical_logits_agree_perfectly():
    rows = np.random.default_rng(0).normal(size=(5, 100))
    agreement = score(rows, rows)
    assert agreement.top1 == 1.0 and agreement.n == 5
    assert agreement.mean_kl == pytest.approx(0.0, abs=1e-12)
    assert agreement.min_cosine == pytest.approx(1.0)


def test_top1_counts_positions_with_the_same_argmax():
    ref = np.array([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    cand = np.array([[2.0, 1.0, 0.0], [0.0, 1.0, 2.0]])
    assert score(cand, ref).top1 == 0.5


def test_kl_matches_the_closed_form():
    ref = np.array([[0.0, math.log(3.0)]])  # p = (0.25, 0.75)
    cand = np.array([[0.0, 0.0]])  # q = (0.5, 0.5)
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    assert score(cand, ref).mean_kl == pytest.approx(expected)


def test_min_cosine_reports_the_worst_position():
    ref = np.array([[1.0, 0.0], [1.0, 0.0]])
    cand = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert score(cand, ref).min_cosine == pytest.approx(0.0)


def test_log_softmax_is_stable_for_huge_logits():
    rows = np.array([[1000.0, 999.0, -1000.0]])
    out = log_softmax(rows)
    assert np.isfinite(out).all()
    assert np.exp(out).sum() == pytest.approx(1.0)
    assert score(rows + 5.0, rows).mean_kl == pytest.approx(0.0, abs=1e-12)  # shift-invariant


@pytest.mark.parametrize(
    "cand, ref, match",
    [
        (np.zeros((2, 3)), np.zeros((2, 4)), "do not match"),
        (np.zeros(3), np.zeros(3), r"\[positions, vocab\]"),
        (np.zeros((0, 3)), np.zeros((0, 3)), "no positions"),
        (np.array([[np.nan, 0.0]]), np.zeros((1, 2)), "candidate logits contain NaN"),
        (np.zeros((1, 2)), np.array([[np.inf, 0.0]]), "reference logits contain NaN"),
    ],
)
def test_bad_inputs_are_refused(cand, ref, match):
    with pytest.raises(ValueError, match=match):
        score(cand, ref)


def test_figures_are_json_able():
    assert set(score(np.eye(3), np.eye(3)).to_dict()) == {"top1", "mean_kl", "min_cosine", "n"}
