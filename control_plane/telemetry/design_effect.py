"""How much fewer independent samples a cohort's timed inferences are worth (design effect).

A latency rule's margin treats inferences as independent draws; they are not quite (a
slow device gives many slow inferences). `design_effects` measures by how much, over
the devices a trim kept (control_plane.telemetry.robust), and
control_plane.rollouts.guardrails widens the margin by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from runtime.histogram import BUCKETS_PER_DOUBLING, MIN_NS, N_BUCKETS

if TYPE_CHECKING:
    from control_plane.telemetry.robust import Devices


# The log of what each histogram bucket holds (its geometric middle; under- and overflow
# read at their inner edge): what the spread of latencies within and between devices is
# measured on.
_LOG_MID = np.log(
    MIN_NS * 2 ** ((np.clip(np.arange(N_BUCKETS), 1, N_BUCKETS - 2) - 0.5) / BUCKETS_PER_DOUBLING)
)


def design_effects(
    devices: Devices, weights: np.ndarray, configs: Sequence[str | None]
) -> dict[str | None, float]:
    """Return how much fewer independent samples a cohort's timed inferences are worth.

    Latencies of one device go together (a slow phone is slow all day), so n inferences
    from g devices carry less than n independent draws: the design effect of cluster
    sampling, 1 + (m - 1) * ICC, with m the size-weighted mean samples per device and ICC
    the share of the variance of log latency that lies between devices (one-way ANOVA
    estimate, clipped to [0, 1]), over the devices kept (`weights` > 0, as scaled), on
    each of `configs` (None: every config). The histograms are read once for them all:
    each config's sums add the same samples in the same order as a pass of its own.
    """
    per_hist = weights[devices.entry_device][devices.hist_entry]
    keep = per_hist > 0
    owner = devices.entry_device[devices.hist_entry[keep]]
    counts = devices.hist_count[keep] * per_hist[keep]
    logs = _LOG_MID[devices.hist_index[keep]]
    terms = (counts, counts * logs, counts * logs * logs)
    width = len(devices)

    def sums(at: np.ndarray, rows: int) -> list[np.ndarray]:
        # Per device (a row per config where `at` names the config too): samples, logs
        # and squared logs.
        return [
            np.bincount(at, weights=t, minlength=rows * width).reshape(rows, width) for t in terms
        ]

    every = sums(owner, 1) if None in configs else None
    named = [c for c in configs if c is not None and c in devices.configs]
    per_config = (
        sums(devices.entry_config[devices.hist_entry[keep]] * width + owner, len(devices.configs))
        if named
        else None
    )
    out = {}
    for config in configs:
        if config is None:
            out[config] = _design_effect(*(s[0] for s in every))
        elif config in named:
            at = devices.configs.index(config)
            out[config] = _design_effect(*(s[at] for s in per_config))
        else:
            out[config] = 1.0
    return out


def _design_effect(n: np.ndarray, total: np.ndarray, square: np.ndarray) -> float:
    """Return the design effect of per-device sums of samples, of logs and of squared logs."""
    held = n > 0
    g = int(held.sum())
    if g < 2:
        return 1.0
    mean = total[held] / n[held]
    square = square[held]
    n = n[held]
    total = n.sum()
    within = float(np.maximum(square / n - mean * mean, 0) @ n)
    grand = float(mean @ n) / total
    msb = float(n @ (mean - grand) ** 2) / (g - 1)
    msw = within / max(total - g, 1.0)
    n0 = (total - float(n @ n) / total) / (g - 1)
    denominator = msb + (n0 - 1) * msw
    icc = min(1.0, max(0.0, (msb - msw) / denominator)) if denominator > 0 else 0.0
    m = float(n @ n) / total
    return max(1.0, 1 + (m - 1) * icc)
