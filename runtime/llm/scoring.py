"""Teacher-forced agreement between a candidate LLM and its reference.

Both models are fed the same prompt and the same (reference) continuation, so every
position compares the two next-token distributions under identical context; a first
disagreement does not derail the rest, as comparing free generations would. The
registry's accuracy gate scores each variant (q4, q8...) against the fp32 reference with
it, and the device's self-test scores what it computes against what the registry
recorded.

Figures: ``top1`` the share of positions where both pick the same most likely token,
``mean_kl`` the mean KL(reference || candidate) in nats, ``min_cosine`` the lowest
cosine similarity between the two logit rows (the worst position, which a mean hides).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

__all__ = ["Agreement", "log_softmax", "score"]


@dataclass(frozen=True)
class Agreement:
    """How closely a candidate's next-token distributions follow the reference's."""

    top1: float  # in [0, 1]
    mean_kl: float  # nats, >= 0
    min_cosine: float  # in [-1, 1]
    n: int  # positions compared

    def to_dict(self) -> dict[str, Any]:
        """Return the figures as JSON-able data."""
        return asdict(self)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Return log-probabilities of each row, in float64, without overflow.

    Subtracting the row maximum first keeps ``exp`` in range for any finite logits
    (a naive softmax of logits around 1000 gives inf/inf).
    """
    x = np.asarray(logits, dtype=np.float64)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def score(candidate: np.ndarray, reference: np.ndarray) -> Agreement:
    """Compare two ``[positions, vocab]`` logit arrays row by row.

    Raises ValueError for arrays of other ranks, different shapes, no positions, or
    non-finite values (a candidate that produces NaN fails loudly instead of scoring
    as "different").
    """
    cand = np.asarray(candidate, dtype=np.float64)
    ref = np.asarray(reference, dtype=np.float64)
    if cand.ndim != 2 or ref.ndim != 2:
        raise ValueError(f"logits must be [positions, vocab]; got {cand.shape} and {ref.shape}")
    if cand.shape != ref.shape:
        raise ValueError(f"candidate logits {cand.shape} do not match reference {ref.shape}")
    if cand.shape[0] == 0 or cand.shape[1] == 0:
        raise ValueError("no positions to compare")
    for name, array in (("candidate", cand), ("reference", ref)):
        if not np.isfinite(array).all():
            raise ValueError(f"{name} logits contain NaN or infinity")
    top1 = float(np.mean(cand.argmax(axis=1) == ref.argmax(axis=1)))
    log_p, log_q = log_softmax(ref), log_softmax(cand)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=1)
    norms = np.linalg.norm(cand, axis=1) * np.linalg.norm(ref, axis=1)
    dots = np.sum(cand * ref, axis=1)
    # A zero row has no direction: it agrees only with another zero row.
    cosine = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), 0.0)
    cosine = np.where((norms == 0) & ~cand.any(axis=1) & ~ref.any(axis=1), 1.0, cosine)
    return Agreement(
        top1=top1,
        mean_kl=float(max(0.0, kl.mean())),  # rounding can make a perfect match -1e-17
        min_cosine=float(np.clip(cosine.min(), -1.0, 1.0)),
        n=int(cand.shape[0]),
    )
