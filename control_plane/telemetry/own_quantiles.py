"""Each device's own latency quantile, and its comparison across cohorts (`device_ratio`).

A health view asks for the quantiles of some twenty groups of devices (each slice's
cohorts and the whole rollout's) on each backend config. Where a group holds one row per
device on a config (a device's rows are one per window: the usual case), a device's
quantile is its row's, so each row's is found once per table (`_row_quantiles`) and the
groups pick theirs; otherwise a group's rows are merged per device first.

`device_ratio` compares two cohorts' device quantiles as trimmed means of their logs (one
of the two readings of a latency rule: control_plane.rollouts.guardrails.judge).
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np

from control_plane.store.device_table import DeviceTable
from runtime.histogram import BUCKETS_PER_DOUBLING, MIN_NS, N_BUCKETS

if TYPE_CHECKING:
    from control_plane.telemetry.robust import Devices

# Below this, sums of whole-number counts are exact in float64 in any order: the per-row
# reading then finds what merging per device finds, to the bit.
_EXACT = 2.0**52


def min_samples(q: float) -> int:
    """Return the timed inferences a device needs for its own q-quantile to mean anything."""
    return max(2, math.ceil(1 / (1 - q) - 1e-9))


@dataclass(frozen=True)
class DeviceQuantiles:
    """Each qualifying device's own q-quantile on one config (or all configs merged)."""

    positions: np.ndarray  # device positions in the Devices they come from
    log_us: np.ndarray  # natural log of the quantile in µs (floored at 1 µs)
    samples: np.ndarray  # timed inferences behind each


def device_quantiles(devices: Devices, q: float, config: str | None) -> DeviceQuantiles:
    """Return the q-quantile of each device with `min_samples(q)` on `config` (None: all)."""
    found = devices.quantile_memo.get((q, config))
    if found is None:
        found = devices.quantile_memo[q, config] = _device_quantiles(devices, q, config)
    return found


def _device_quantiles(devices: Devices, q: float, config: str | None) -> DeviceQuantiles:
    if config is not None and config not in devices.configs:
        empty = np.zeros(0)
        return DeviceQuantiles(np.zeros(0, np.intp), empty, empty)
    entries = (
        np.ones(len(devices.positions), bool)
        if config is None
        else devices.entry_config == devices.configs.index(config)
    )
    n_dev = len(devices)
    counts = np.bincount(
        devices.entry_device[entries], weights=devices.latency_count[entries], minlength=n_dev
    )
    wanted = np.flatnonzero(counts >= min_samples(q))
    if not wanted.size:
        empty = np.zeros(0)
        return DeviceQuantiles(wanted, empty, empty)
    found = _from_rows(devices, q, entries, wanted)
    if found is not None:
        return found
    row = np.full(n_dev, -1, np.intp)
    row[wanted] = np.arange(len(wanted))
    hist_entry_ok = entries[devices.hist_entry]
    hist_row = row[devices.entry_device[devices.hist_entry]]
    keep = hist_entry_ok & (hist_row >= 0)
    # One row of buckets per device, over the buckets any of them filled (below and above
    # that range every row is empty: the quantile's bucket is within it).
    filled = devices.hist_index[keep]
    first = int(filled.min()) if filled.size else 0
    span = int(filled.max()) - first + 1 if filled.size else 1
    dense = np.bincount(
        hist_row[keep] * span + (filled - first),
        weights=devices.hist_count[keep],
        minlength=len(wanted) * span,
    ).reshape(len(wanted), span)
    n = dense.sum(axis=1)
    rank = np.maximum(1.0, np.ceil(q * n - 1e-9))
    index = first + np.argmax(np.cumsum(dense, axis=1) >= rank[:, None] - 1e-9, axis=1)
    index[n == 0] = 0  # timed inferences but no buckets (never stored): read as its low
    low, high = _observed_range(devices, entries)
    return DeviceQuantiles(wanted, _log_us(index, low[wanted], high[wanted]), n)


def _log_us(index: np.ndarray, low: np.ndarray, high: np.ndarray) -> np.ndarray:
    """Return the log (µs) of quantiles in buckets `index`, within [low, high] ns."""
    middle = MIN_NS * 2 ** ((index - 0.5) / BUCKETS_PER_DOUBLING)  # the bucket's geometric mid
    value_ns = np.where(index == 0, low, np.where(index == N_BUCKETS - 1, high, middle))
    value_ns = np.clip(value_ns, low, high)  # within what the device saw, as quantile_us reads
    return np.log(np.maximum(value_ns / 1000, MIN_NS / 1000))


def _observed_range(devices: Devices, entries: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return per device the lowest and highest latency it reported on `entries` (ns)."""
    timed = entries & (devices.latency_count > 0)
    low = np.full(len(devices), np.inf)
    high = np.full(len(devices), -np.inf)
    owner = devices.entry_device[timed]
    np.minimum.at(low, owner, np.nan_to_num(devices.latency_min[timed], nan=np.inf))
    np.maximum.at(high, owner, np.nan_to_num(devices.latency_max[timed], nan=-np.inf))
    return np.where(np.isfinite(low), low, 0.0), np.where(np.isfinite(high), high, np.inf)


def _from_rows(
    devices: Devices, q: float, entries: np.ndarray, wanted: np.ndarray
) -> DeviceQuantiles | None:
    """Return the `wanted` devices' quantiles from their rows' (None: not one row each)."""
    chosen = np.flatnonzero(entries)
    owner = devices.entry_device[chosen]
    if np.bincount(owner, minlength=len(devices))[wanted].max() > 1:
        return None
    per_row = _row_quantiles(devices.table, q)
    if per_row is None:
        return None
    entry = np.full(len(devices), -1, np.intp)
    entry[owner] = chosen
    rows = devices.positions[entry[wanted]]
    index, n = per_row[0][rows], per_row[1][rows]
    # As _observed_range reads one row (timed: a wanted device has min_samples >= 2).
    low, high = devices.table.latency_min_ns[rows], devices.table.latency_max_ns[rows]
    low = np.where(np.isfinite(low), low, 0.0)
    high = np.where(np.isfinite(high), high, np.inf)
    return DeviceQuantiles(wanted, _log_us(index, low, high), n)


_ROW_QUANTILES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _row_quantiles(table: DeviceTable, q: float) -> tuple[np.ndarray, np.ndarray] | None:
    """Return per row of `table` the bucket of its q-quantile and its samples (cached).

    As `_device_quantiles` reads a device of one row, to the bit: its cumulative counts
    are whole numbers below 2**52 (exact in any order), and each row's buckets ascend.
    None where that does not hold.
    """
    memo = _ROW_QUANTILES.setdefault(table, {})
    if q not in memo:
        memo[q] = _rows_read(table, q)
    return memo[q]


def _rows_read(table: DeviceTable, q: float) -> tuple[np.ndarray, np.ndarray] | None:
    counts, rows, index = table.hist_count, table.hist_row, table.hist_index
    same_row = rows[1:] == rows[:-1]
    if (counts < 0).any() or not counts.sum() < _EXACT or (np.diff(index)[same_row] <= 0).any():
        return None
    cum = np.cumsum(counts)
    start = np.searchsorted(rows, np.arange(len(table) + 1))
    before = np.concatenate(([0.0], cum))[start]
    n = before[1:] - before[:-1]
    rank = np.maximum(1.0, np.ceil(q * n - 1e-9))
    hit = np.flatnonzero(cum - before[:-1][rows] >= (rank - 1e-9)[rows])
    first = np.concatenate(([True], rows[hit][1:] != rows[hit][:-1]))  # a row's first hit
    out = np.zeros(len(table), np.intp)  # a row with no buckets: read as its low, as there
    out[rows[hit][first]] = index[hit][first]
    return out, n


# -- compared across cohorts as trimmed means ------------------------------------------


def comparable_quantile_configs(
    candidate: Devices, baseline: Devices, q: float, k: int
) -> list[str]:
    """Return the configs compared like with like, for latency quantile `q`.

    Those on which each cohort has more than 2k devices with their own q-quantile
    (`min_samples(q)` timed inferences).
    """
    common = set(candidate.configs) & set(baseline.configs)
    return sorted(
        c
        for c in common
        if min(
            len(device_quantiles(candidate, q, c).positions),
            len(device_quantiles(baseline, q, c).positions),
        )
        > 2 * k
    )


@dataclass(frozen=True)
class Trimmed:
    """A trimmed mean over devices, with Yuen's variance of it (winsorized)."""

    mean: float
    variance: float  # of the trimmed mean
    kept: int
    left_out: np.ndarray  # positions (into the values given) left out
    spread: float  # the winsorized variance of the values themselves


def trimmed(values: np.ndarray, k: int) -> Trimmed:
    """Return the mean of `values` without the k highest and k lowest, and its variance.

    Yuen's estimate: the winsorized variance (the k lowest set to the next value up, the
    k highest to the next down) over h(h-1)/(n-1), h the values kept. Needs n > 2k.
    """
    n = len(values)
    h = n - 2 * k
    if h < 1:
        raise ValueError(f"{n} values cannot be trimmed by {k} each way")
    order = np.argsort(values, kind="stable")
    ranked = values[order]
    kept = ranked[k : n - k]
    spread = float(np.var(winsorized(ranked, k, ranked), ddof=1)) if n > 1 else 0.0
    variance = (n - 1) * spread / (h * (h - 1)) if h > 1 else math.inf
    gone = np.concatenate([order[:k], order[n - k :]]) if k else np.zeros(0, np.intp)
    return Trimmed(float(kept.mean()), variance, h, gone, spread)


def winsorized(values: np.ndarray, k: int, ranked: np.ndarray | None = None) -> np.ndarray:
    """Return `values` with the k lowest set to the next value up, the k highest to the next down.

    `ranked`: the values sorted, if the caller has them. Needs len(values) > 2k.
    """
    ranked = np.sort(values) if ranked is None else ranked
    return np.clip(values, ranked[k], ranked[len(values) - k - 1])


@dataclass(frozen=True)
class DeviceRatio:
    """Candidate over baseline of the devices' own q-quantiles (trimmed means of logs)."""

    log_ratio: float
    standard_error: float
    candidate_us: float
    baseline_us: float
    left_out: dict[str, list[str]]
    slower: dict[str, float]  # candidate device id -> its log ratio to the baseline


def device_ratio(candidate: Devices, baseline: Devices, q: float, k: int) -> DeviceRatio | None:
    """Compare each device's own q-quantile across cohorts; None with too few devices.

    Per config each cohort ran on more than 2k devices with `min_samples(q)` timed
    inferences (all configs merged per device only when the cohorts share none), of which
    at least two are left after trimming (a config with fewer has no spread to weigh it
    by): the k highest and k lowest device quantiles of each cohort are left out, the
    trimmed means of their logs compared, and the difference's standard error is Yuen's,
    over devices: as wide as devices differ.

    Where configs are too thin for that, each candidate device is read against its
    config's baseline level instead (`_against_levels`): that reading decides whenever it
    reads more candidate devices than the configs compared apart hold. So a slice of 6
    candidates, 3 on each of two configs (k = 1), is judged on all 6, and one device that
    joins a config as its fourth cannot narrow the judgement to that config's 4.
    """
    shared = set(candidate.configs) & set(baseline.configs)
    levels = _against_levels(candidate, baseline, q, k) if shared else None
    apart = _config_by_config(candidate, baseline, q, k, shared)
    if apart is None or (levels is not None and len(levels.slower) > len(apart.slower)):
        return levels
    return apart


def _config_by_config(
    candidate: Devices, baseline: Devices, q: float, k: int, shared: set
) -> DeviceRatio | None:
    configs = comparable_quantile_configs(candidate, baseline, q, k)
    if not configs:
        if shared:
            return None  # never mixed raw across configs
        configs = [None]
    total = log_ratio = log_c = log_b = variance = 0.0
    left: dict[str, set] = {"candidate": set(), "baseline": set()}
    slower: dict[str, float] = {}
    for config in configs:
        dc, db = device_quantiles(candidate, q, config), device_quantiles(baseline, q, config)
        if min(len(dc.log_us), len(db.log_us)) <= 2 * k + 1:
            # Fewer than two devices left after trimming: no spread to weigh this config
            # by (Yuen's variance is infinite), and one such config must not void the
            # others' evidence.
            continue
        tc, tb = trimmed(dc.log_us, k), trimmed(db.log_us, k)
        weight = tc.kept * tb.kept / (tc.kept + tb.kept)
        total += weight
        log_ratio += weight * (tc.mean - tb.mean)
        log_c, log_b = log_c + weight * tc.mean, log_b + weight * tb.mean
        variance += weight * weight * (tc.variance + tb.variance)
        left["candidate"].update(candidate.ids[dc.positions[i]] for i in tc.left_out)
        left["baseline"].update(baseline.ids[db.positions[i]] for i in tb.left_out)
        for position, value in zip(dc.positions, dc.log_us, strict=True):
            device = candidate.ids[position]
            slower[device] = max(slower.get(device, -math.inf), float(value - tb.mean))
    if not total:
        return None
    return DeviceRatio(
        log_ratio / total,
        math.sqrt(variance) / total,
        math.exp(log_c / total),
        math.exp(log_b / total),
        {who: sorted(ids) for who, ids in left.items() if ids},
        slower,
    )


# The degrees of freedom (devices kept after trimming, less one a config, over the configs
# where a spread is measured) the baseline's spread needs before devices are read against
# levels. Found by an attack review: from one config of 2k + 2 devices (one degree) the
# spread was exactly 0 in a third of honest draws (their quantiles tie in a bucket), or
# whenever one liar copied the median device; the margin was then none, and a healthy
# slice of 2k + 1 candidates failed (3 against 4: 53 of 3000; with a liar: 65 of 1000).
MIN_SPREAD_DF = 4


def _borrowed(level: Trimmed, spread: float) -> Trimmed:
    """Return a level with its variance, where it cannot measure one, from `spread`.

    A config with 2k + 1 baseline devices keeps one after trimming: its level is their
    median, which k of them cannot move beyond the others, but its own spread is
    unmeasured (Yuen's variance is infinite). Its variance is then the large-sample one of
    a median, pi/2 * spread / n, over `spread`, one device's variance as the baseline shows
    it on other configs: a little wider than the exact 0.45 * spread of a median of 3
    normal draws.
    """
    if level.kept > 1:
        return level
    n = level.kept + len(level.left_out)
    return replace(level, variance=math.pi / 2 * spread / n)


def _against_levels(candidate: Devices, baseline: Devices, q: float, k: int) -> DeviceRatio | None:
    """Compare each candidate device with its config's baseline level; None if none can be.

    A config's level is the trimmed mean of its baseline devices' log quantiles, on configs
    with more than 2k of them (with 2k + 1, their median: its variance is borrowed from the
    baseline's spread on configs where that is measured, `_borrowed`; with fewer than
    MIN_SPREAD_DF degrees of freedom there, nothing is read); each candidate device on
    such configs gives one value, its log quantile less its config's level (the mean of its
    configs' where it ran several: one device, one value), and the trimmed mean of those
    values, k left out each way, is the log ratio. So a thin slice is still compared like
    with like, and a device alone on a config (in either cohort) has no level to be read
    against. Needs more than 2k candidate devices (with 2k + 1, their median is read,
    its variance that of a mean of one device at the baseline's spread: wider than a
    median's).

    The standard error is of a mean over the devices kept, from their spread within their
    configs (a slowdown on one config only is an effect, not noise between devices), never
    below what the baseline's own spread within its configs gives for that many devices
    (a handful of candidates measures its spread poorly, and a few hostile ones must not
    narrow it), plus each level's own variance, weighted by its share of the candidates.
    """
    levels: dict[str, tuple[DeviceQuantiles, Trimmed]] = {}
    for config in sorted(set(candidate.configs) & set(baseline.configs)):
        db = device_quantiles(baseline, q, config)
        if len(db.log_us) > 2 * k:
            levels[config] = (db, trimmed(db.log_us, k))
    # The baseline's spread between devices within a config, from the configs where it
    # can be measured (two devices or more left after trimming): the floor of the
    # candidates' spread, and what a thin config's level borrows as its own.
    measured = [(len(db.log_us), level) for db, level in levels.values() if level.kept > 1]
    df = sum(level.kept - 1 for _, level in measured)
    if df < MIN_SPREAD_DF:
        return None
    # One device's variance, as Yuen's estimate has it: the winsorized spread runs low
    # (0.22 of it from 4 devices, 0.73 from 12), and ties of devices' quantiles in one
    # histogram bucket make it 0 more often than chance would.
    floor = sum((n - 1) * level.spread for n, level in measured) / df
    levels = {c: (db, _borrowed(level, floor)) for c, (db, level) in levels.items()}
    share = np.zeros((len(candidate), len(levels)))  # device x level: its configs' weights
    total = np.zeros(len(candidate))
    for j, (config, (_, level)) in enumerate(levels.items()):
        dc = device_quantiles(candidate, q, config)
        share[dc.positions, j] = 1.0
        total[dc.positions] += dc.log_us - level.mean
    read = np.flatnonzero(share.sum(axis=1))
    if len(read) <= 2 * k:
        return None
    share = share[read] / share[read].sum(axis=1, keepdims=True)  # each device's row sums to 1
    values = total[read] / np.count_nonzero(share, axis=1)
    mine = trimmed(values, k)
    kept = np.setdiff1d(np.arange(len(read)), mine.left_out)
    h = len(kept)
    weights = share[kept].sum(axis=0) / h  # per level
    # Within configs: each kept value less its configs' mean over the kept devices.
    used = weights > 0
    means = (share[kept][:, used].T @ values[kept]) / share[kept][:, used].sum(axis=0)
    residual = values[kept] - share[kept][:, used] @ means
    within = float(residual @ residual) / max(h - int(used.sum()), 1)
    variance = max(within, floor) / h + sum(
        w * w * level.variance for w, (_, level) in zip(weights, levels.values(), strict=True)
    )
    base_log = float(weights @ np.array([level.mean for _, level in levels.values()]))
    left = {"candidate": sorted(candidate.ids[read[i]] for i in mine.left_out)}
    left["baseline"] = sorted(
        {
            baseline.ids[db.positions[i]]
            for j, (db, level) in enumerate(levels.values())
            if weights[j]
            for i in level.left_out
        }
    )
    return DeviceRatio(
        mine.mean,
        math.sqrt(variance),
        math.exp(mine.mean + base_log),
        math.exp(base_log),
        {who: ids for who, ids in left.items() if ids},
        {candidate.ids[p]: float(values[i]) for i, p in enumerate(read)},
    )
