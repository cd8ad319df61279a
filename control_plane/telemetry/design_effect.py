"""How much fewer independent samples a cohort's timed inferences are worth (design effect).

A latency rule's margin treats inferences as independent draws; they are not quite (a
slow device gives many slow inferences). `design_effects` measures by how much, robust
to the k devices a verdict must withstand, and control_plane.rollouts.guardrails widens
the margin by it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from control_plane.telemetry.own_quantiles import winsorized
from control_plane.telemetry.robust import capped
from runtime.histogram import BUCKETS_PER_DOUBLING, MIN_NS, N_BUCKETS

if TYPE_CHECKING:
    from control_plane.store.device_table import DeviceTable
    from control_plane.telemetry.robust import Devices


# The log of what each histogram bucket holds (its geometric middle; under- and overflow
# read at their inner edge): what the spread of latencies within and between devices is
# measured on.
_LOG_MID = np.log(
    MIN_NS * 2 ** ((np.clip(np.arange(N_BUCKETS), 1, N_BUCKETS - 2) - 0.5) / BUCKETS_PER_DOUBLING)
)


def design_effects(
    candidate: Devices,
    candidate_weights: np.ndarray,
    baseline: Devices,
    baseline_weights: np.ndarray,
    configs: Sequence[str | None],
    k: int = 0,
) -> dict[str | None, tuple[float, float]]:
    """Return per config (None: every config) the candidate's and the baseline's design effect.

    Latencies of one device go together (a slow phone is slow all day), so n inferences
    from g devices carry less than n independent draws: the design effect of cluster
    sampling, 1 + (m - 1) * ICC. m is each cohort's own: the size-weighted mean samples
    of its devices kept (weights > 0, as scaled) on the config. The ICC, the share of the
    variance of log latency between devices, is the baseline's (healthy by assumption;
    the candidate's spread could be the regression), measured once over all its devices,
    each compared with the others on its own config (`intraclass`): on a compared config
    alone it rests on as few as one or two devices kept, which often show no spread by
    chance, and the margin was then that of independent samples. Any device may lie, so
    the ICC is robust to `k` of them on every config it reads, those the latency trim
    never looked at included. Where it cannot be measured (too few devices on every
    config), the margin is that of independent samples.
    """
    # The ICC from every baseline device as capped, not as the latency trim weighed them:
    # that trim looks only at compared configs, and by influence on a quantile, not by
    # level or spread; `intraclass` withstands k liars on every config itself, and on top
    # of that trim it would read too few devices to measure anything.
    scales = capped(baseline.per_device("latency_count"))
    icc = intraclass(baseline, scales, baseline.configs if list(configs) != [None] else [None], k)
    sizes = [
        cluster_sizes(devices, weights, configs)
        for devices, weights in ((candidate, candidate_weights), (baseline, baseline_weights))
    ]
    return {
        config: tuple(max(1.0, 1 + (float(size[i]) - 1) * (icc or 0.0)) for size in sizes)
        for i, config in enumerate(configs)
    }


def _cluster_of(
    devices: Devices, weights: np.ndarray, configs: Sequence[str | None]
) -> tuple[np.ndarray, np.ndarray]:
    """Return per entry its cluster (-1: not counted) and its scale (its device's weight).

    A cluster is a device's samples on one of `configs` ([None]: on every config), numbered
    device * len(configs) + the config's position in `configs`.
    """
    groups = len(configs)
    if list(configs) == [None]:
        group_of = np.zeros(max(1, len(devices.configs)), np.intp)
    else:
        group_of = np.full(max(1, len(devices.configs)), -1, np.intp)
        for g, config in enumerate(configs):
            if config in devices.configs:
                group_of[devices.configs.index(config)] = g
    entry_group = group_of[devices.entry_config]
    scale = weights[devices.entry_device] * (entry_group >= 0)
    cluster = np.where(scale > 0, devices.entry_device * groups + entry_group, -1)
    return cluster, scale


def cluster_sizes(
    devices: Devices, weights: np.ndarray, configs: Sequence[str | None]
) -> np.ndarray:
    """Return per config of `configs` the size-weighted mean timed inferences per device kept.

    1 where no device kept ran it.
    """
    cluster, scale = _cluster_of(devices, weights, configs)
    counted = cluster >= 0
    n = np.bincount(
        cluster[counted],
        weights=devices.latency_count[counted] * scale[counted],
        minlength=len(devices) * len(configs),
    ).reshape(len(devices), len(configs))
    total = n.sum(axis=0)
    return np.where(total > 0, (n * n).sum(axis=0) / np.maximum(total, 1e-300), 1.0)


_ROW_MOMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _row_moments(table: DeviceTable) -> np.ndarray:
    """Return per row of `table` its samples and their log latency's sum and sum of squares.

    Read once per table (a health view's cohorts are groups of its rows), in a row each.
    """
    found = _ROW_MOMENTS.get(table)
    if found is None:
        logs = _LOG_MID[table.hist_index]
        found = _ROW_MOMENTS[table] = np.stack(
            [
                np.bincount(table.hist_row, weights=w, minlength=len(table))
                for w in (table.hist_count, table.hist_count * logs, table.hist_count * logs * logs)
            ]
        )
    return found


def intraclass(
    devices: Devices, weights: np.ndarray, configs: Sequence[str | None] = (None,), k: int = 0
) -> float | None:
    """Return the share of the variance of log latency that lies between devices.

    The one-way ANOVA estimate, clipped to [0, 1], over the devices kept (`weights` > 0,
    as scaled): each device's samples on a config are one cluster, compared with the
    other clusters on that config (a config's own level is no device's; [None]: every
    config as one). None where it cannot be measured: one cluster on each config.

    With `k` > 0, robust to k devices that lie on each config: a config is read only
    where it has more than 2k + 1 clusters, their means winsorized k each way (a liar far
    off counts as the k+1-th most extreme device does), and the spread within devices is
    the median device's, not the pooled one (a liar with a wide or a narrow spread of its
    own cannot move it past an honest device's).
    """
    cluster, scale = _cluster_of(devices, weights, configs)
    counted = cluster >= 0
    moments = _row_moments(devices.table)[:, devices.positions[counted]] * scale[counted]
    size = len(devices) * len(configs)
    n, total, square = (np.bincount(cluster[counted], weights=m, minlength=size) for m in moments)
    held = np.flatnonzero(n > 0)
    n, total, square, group = n[held], total[held], square[held], held % len(configs)
    mean = total / n
    spread = np.maximum(square / n - mean * mean, 0)
    if k > 0:
        keep, mean = _winsorized(mean, group, k)
        n, mean, spread, group = n[keep], mean[keep], spread[keep], group[keep]
    present = np.unique(group)
    df_between = len(n) - len(present)
    if df_between < 1:
        return None
    size = np.bincount(group, weights=n)
    level = np.bincount(group, weights=n * mean)[group] / size[group]
    all_n = float(n.sum())
    msb = float(n @ (mean - level) ** 2) / df_between
    if k > 0:
        msw = float(np.median(spread))
    else:
        msw = float(spread @ n) / max(all_n - len(n), 1.0)
    own = np.bincount(group, weights=n * n)[present] / size[present]
    n0 = (all_n - float(own.sum())) / df_between
    denominator = msb + (n0 - 1) * msw
    return min(1.0, max(0.0, (msb - msw) / denominator)) if denominator > 0 else 0.0


def _winsorized(mean: np.ndarray, group: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Return which clusters `intraclass` reads with k liars a config, and their means.

    A config with more than 2k + 1 clusters is read, each mean clipped to the k+1-th
    lowest and highest of its config's; one with fewer is not: nothing there could be
    told from a liar.
    """
    keep = np.zeros(len(mean), bool)
    clipped = mean.copy()
    for g in np.unique(group):
        at = np.flatnonzero(group == g)
        if len(at) <= 2 * k + 1:
            continue
        clipped[at] = winsorized(mean[at], k)
        keep[at] = True
    return keep, clipped
