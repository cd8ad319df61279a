"""How much fewer independent samples a cohort's timed inferences are worth (design effect).

A latency rule's margin treats inferences as independent draws; they are not quite (a
slow device gives many slow inferences). `design_effect` measures by how much, over
the devices a trim kept (control_plane.telemetry.robust), and
control_plane.rollouts.guardrails widens the margin by it.
"""

from __future__ import annotations

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


def design_effect(devices: Devices, weights: np.ndarray, config: str | None = None) -> float:
    """Return how much fewer independent samples a cohort's timed inferences are worth.

    Latencies of one device go together (a slow phone is slow all day), so n inferences
    from g devices carry less than n independent draws: the design effect of cluster
    sampling, 1 + (m - 1) * ICC, with m the size-weighted mean samples per device and ICC
    the share of the variance of log latency that lies between devices (one-way ANOVA
    estimate, clipped to [0, 1]), over the devices kept (`weights` > 0, as scaled), on
    `config` (None: every config).
    """
    entries = np.ones(len(devices.positions), bool)
    if config is not None:
        if config not in devices.configs:
            return 1.0
        entries = devices.entry_config == devices.configs.index(config)
    scale = weights[devices.entry_device] * entries
    per_hist = scale[devices.hist_entry]
    keep = per_hist > 0
    if not keep.any():
        return 1.0
    owner = devices.entry_device[devices.hist_entry[keep]]
    counts = devices.hist_count[keep] * per_hist[keep]
    logs = _LOG_MID[devices.hist_index[keep]]
    n = np.bincount(owner, weights=counts, minlength=len(devices))
    held = n > 0
    g = int(held.sum())
    if g < 2:
        return 1.0
    mean = np.bincount(owner, weights=counts * logs, minlength=len(devices))[held] / n[held]
    square = np.bincount(owner, weights=counts * logs * logs, minlength=len(devices))[held]
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
