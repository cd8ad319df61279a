"""Figures no few devices can swing: each device's weight capped, the extremes left out.

Everything a device reports is its own word. Guardrail verdicts and backend
recommendations are therefore computed from each device's own figures (one row per
device and backend config: control_plane.store.rollup_records.DeviceRollup), in two steps:

1. **Cap.** No device counts for more than `CAP_FACTOR` times the median device of its
   group (by inferences for rates, by timed inferences for latency): a device reporting
   a million samples weighs what four ordinary ones do, its counts and histogram scaled
   down in proportion.
2. **Trim.** The `k` devices that pull the figure hardest one way and the `k` that pull
   it hardest the other way are left out. How hard a device pulls is its influence on
   the figure: for a rate, its events minus the rate times its inferences; for a
   quantile Q, its samples below Q short of (or beyond) the share q it would have if it
   were like the rest (the quantile's influence function, summed over its samples).

So any k devices, whatever they send, are either left out or weigh no more than capped
honest ones: they can neither make a healthy group look broken nor a broken one look
healthy. k is a setting (`guard_outliers`, default 1); a group needs more than 2k devices
before anything is judged from it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable, Sequence

import numpy as np

from contract import errors
from control_plane.store.device_table import DeviceTable
from control_plane.store.rollup_aggregate import COUNTERS, INSTALL_COUNTERS, Aggregate
from control_plane.store.rollup_records import DeviceRollup
from control_plane.telemetry.own_quantiles import (  # noqa: F401 - robust's API
    DeviceQuantiles,
    device_quantiles,
    min_samples,
)
from runtime.histogram import N_BUCKETS

CAP_FACTOR = 4.0
DEFAULT_OUTLIERS = 1
MAX_OUTLIERS = 100
_COUNTER = {name: i for i, name in enumerate(COUNTERS)}


def check_robustness(outliers: int, min_devices: int) -> None:
    """Refuse settings that would leave verdicts to a device or judge nothing at all."""
    if not 0 <= outliers <= MAX_OUTLIERS:
        raise errors.InvalidArgument(
            f"guard_outliers must be 0 to {MAX_OUTLIERS} (devices left out each way), "
            f"not {outliers}"
        )
    if min_devices < 1:
        raise errors.InvalidArgument(f"recommend_min_devices must be at least 1, not {min_devices}")


class Devices:
    """One group of devices (a cohort in a window, a config on a device class) as arrays.

    One entry per row of the table it comes from (a device and a backend config).
    """

    def __init__(self, table: DeviceTable, positions: np.ndarray | None = None) -> None:
        self.table = table
        rows = np.arange(len(table)) if positions is None else np.asarray(positions, np.intp)
        self.positions = rows
        devices, self.entry_device = _compact(table.device_code[rows])
        configs, self.entry_config = _compact(table.config_code[rows])
        self.ids = list(table.device_id[table.device_first_row[devices]])
        self.configs = list(table.config[table.config_first_row[configs]])
        self.counters = table.counters[rows]
        self.latency_count = table.latency_count[rows]
        self.latency_sum = table.latency_sum_ns[rows]
        self.latency_min = table.latency_min_ns[rows]
        self.latency_max = table.latency_max_ns[rows]
        self.hist_entry, self.hist_index, self.hist_count = table.histograms(rows)
        # device_quantiles per (q, config): a health view asks for each several times
        # (which configs compare, then the comparison); the arrays are never changed.
        self.quantile_memo: dict[tuple[float, str | None], DeviceQuantiles] = {}

    @classmethod
    def of(cls, rows: Iterable[DeviceRollup]) -> Devices:
        """Return a group of rows read one by one (tests, small reads)."""
        return cls(DeviceTable.from_rows(list(rows)))

    @property
    def rows(self) -> list[DeviceRollup]:
        """Return the group's rows one by one."""
        return self.table.take(self.positions).rows()

    def __len__(self) -> int:
        return len(self.ids)

    def per_device(self, counter: str) -> np.ndarray:
        """Return one counter summed per device."""
        if counter == "latency_count":
            values = self.latency_count
        elif counter == "install_outcomes":
            values = self.counters[:, [_COUNTER[name] for name in INSTALL_COUNTERS]].sum(axis=1)
        elif counter == "install_failures":
            values = (
                self.counters[:, _COUNTER["installs_failed"]]
                + self.counters[:, _COUNTER["installs_rolled_back"]]
            )
        else:
            values = self.counters[:, _COUNTER[counter]]
        return np.bincount(self.entry_device, weights=values, minlength=len(self))

    def with_any(self, counter: str) -> int:
        """Return how many devices report at least one of `counter`."""
        return int(np.count_nonzero(self.per_device(counter) > 0))

    def pooled(self, weights: np.ndarray | None = None, config: str | None = None) -> Aggregate:
        """Return the devices' aggregate, each device scaled by its weight (0: left out).

        Unscaled (weights None), counts are the exact integer sums and crash signals are
        kept; scaled, counts are floats (figures to judge, never stored).
        """
        scale = self._scale(weights, config)
        if scale is None:
            return Aggregate()
        held = self.hist_count * scale[self.hist_entry]
        buckets = np.bincount(self.hist_index, weights=held, minlength=N_BUCKETS)[:N_BUCKETS]
        agg = self._pool(scale, buckets, weights is None)
        if self.table.ttft is not None:
            agg.ttft = self.ttft().pooled(weights, config).histogram_only()
        return agg

    def pooled_all(
        self, weights: np.ndarray | None = None
    ) -> tuple[Aggregate, dict[str, Aggregate]]:
        """Return `pooled(weights)` and `by_config(weights)`, each histogram read once."""
        scale = self._scale(weights, None)
        held = self.hist_count * scale[self.hist_entry]
        buckets = np.bincount(self.hist_index, weights=held, minlength=N_BUCKETS)[:N_BUCKETS]
        whole = self._pool(scale, buckets, weights is None)
        per_config = self._by_config(weights, self.config_buckets(held))
        if self.table.ttft is not None:
            ttft, ttft_configs = self.ttft().pooled_all(weights)
            whole.ttft = ttft.histogram_only()
            for config, agg in per_config.items():
                agg.ttft = ttft_configs[config].histogram_only()
        return whole, per_config

    def by_config(self, weights: np.ndarray | None = None) -> dict[str, Aggregate]:
        """Return `pooled` per backend config."""
        scale = self._scale(weights, None)
        per_config = self._by_config(
            weights, self.config_buckets(self.hist_count * scale[self.hist_entry])
        )
        if self.table.ttft is not None:
            for config, agg in self.ttft().by_config(weights).items():
                per_config[config].ttft = agg.histogram_only()
        return per_config

    def _by_config(self, weights: np.ndarray | None, buckets: np.ndarray) -> dict[str, Aggregate]:
        return {
            config: self._pool(self._scale(weights, config), buckets[i], weights is None)
            for i, config in enumerate(self.configs)
        }

    def config_buckets(self, held: np.ndarray) -> np.ndarray:
        """Return per config (a row each, as `configs`) the histogram of `held` samples.

        `held` is per histogram entry, as `hist_count` scaled. One pass for every config:
        each config's buckets sum the same samples in the same order as `pooled`'s of
        that config (whose other configs' samples count 0), so the same floats, to the bit.
        """
        width = N_BUCKETS + 1  # an index past the last bucket (never stored) is dropped
        sums = np.bincount(self._config_bucket, weights=held, minlength=len(self.configs) * width)
        return sums.reshape(len(self.configs), width)[:, :N_BUCKETS]

    @functools.cached_property
    def _config_bucket(self) -> np.ndarray:
        width = N_BUCKETS + 1
        return self.entry_config[self.hist_entry] * width + np.minimum(self.hist_index, N_BUCKETS)

    def _pool(self, scale: np.ndarray | None, buckets: np.ndarray, exact: bool) -> Aggregate:
        """Return `pooled` of entries scaled by `scale`, their histogram summed (`buckets`)."""
        agg = Aggregate()
        if scale is None:
            return agg
        for name, total in zip(COUNTERS, scale @ self.counters, strict=True):
            setattr(agg, name, round(total) if exact else float(total))
        agg.buckets = np.rint(buckets).astype(np.int64) if exact else buckets
        count, total_ns = float(scale @ self.latency_count), float(scale @ self.latency_sum)
        if count > 0:
            # The lowest and highest of the timed entries kept (NaN: none reported).
            timed = (scale > 0) & (self.latency_count > 0)
            low = np.fmin.reduce(np.where(timed, self.latency_min, np.nan))
            high = np.fmax.reduce(np.where(timed, self.latency_max, np.nan))
            agg._add_latency(
                round(count) if exact else count,
                round(total_ns) if exact else total_ns,
                int(low) if np.isfinite(low) else None,
                int(high) if np.isfinite(high) else None,
            )
        if exact:
            kept = self._with_signals[scale[self._with_signals] > 0]
            for signals in self.table.crash_signals[self.positions[kept]]:
                agg.crash_signals.update(signals)
        return agg

    @functools.cached_property
    def _with_signals(self) -> np.ndarray:
        """Return the entries whose rows name crash signals (few, if any)."""
        return np.flatnonzero(self.table.with_signals[self.positions])

    def timed(self, weights: np.ndarray, config: str | None = None) -> float:
        """Return `pooled(weights, config).latency_count`, without pooling the rest."""
        scale = self._scale(weights, config)
        return 0.0 if scale is None else float(scale @ self.latency_count)

    def _scale(self, weights: np.ndarray | None, config: str | None) -> np.ndarray | None:
        """Return each entry's scale in `pooled` (None: the devices never ran `config`)."""
        if config is None:
            entries = np.ones(len(self.positions), np.float64)
        elif config in self.configs:
            entries = self._config_entries[self.configs.index(config)]
        else:
            return None
        return entries if weights is None else weights[self.entry_device] * entries

    @functools.cached_property
    def _config_entries(self) -> list[np.ndarray]:
        """Return per config 1.0 for its entries, 0.0 for the rest (never changed)."""
        return [(self.entry_config == i).astype(np.float64) for i in range(len(self.configs))]

    def ttft(self) -> Devices:
        """Return the same devices with time to first token as their latency (built once)."""
        return self._ttft

    @functools.cached_property
    def _ttft(self) -> Devices:
        return Devices(self.table.ttft_view(), self.positions)

    def configs_with_devices(self, at_least: int) -> list[str]:
        """Return the configs at least `at_least` devices ran (with timed inferences)."""
        timed = self.latency_count > 0
        ran = np.zeros((len(self.configs), len(self)), bool)  # config x device
        ran[self.entry_config[timed], self.entry_device[timed]] = True
        counts = ran.sum(axis=1)
        return [c for c, n in zip(self.configs, counts, strict=True) if n >= at_least]

    def device(self, position: int) -> Devices:
        """Return one device's rows as a group of its own."""
        return Devices(self.table, self.positions[self.entry_device == position])

    def below(self, entry_slot: np.ndarray, q_index: np.ndarray) -> np.ndarray:
        """Return per entry the samples in buckets at or below its slot's `q_index`.

        `entry_slot` maps each entry to a slot of `q_index` (-1: none).
        """
        slot = entry_slot[self.hist_entry]
        limit = np.where(slot >= 0, q_index[np.maximum(slot, 0)], -1)
        mask = self.hist_index <= limit
        return np.bincount(
            self.hist_entry[mask], weights=self.hist_count[mask], minlength=len(self.positions)
        )


def _compact(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Return `np.unique(codes, return_inverse=True)` of small non-negative integer codes.

    In one pass over a table of the codes instead of a sort: a health view groups rows
    into devices and configs some hundreds of times.
    """
    if not codes.size:
        return codes[:0], np.zeros(0, np.intp)
    largest = int(codes.max())
    if largest > 8 * codes.size:  # a few rows of a large table: sorting them is less
        return np.unique(codes, return_inverse=True)
    seen = np.zeros(largest + 1, bool)
    seen[codes] = True
    values = np.flatnonzero(seen)
    slot = np.zeros(len(seen), np.intp)
    slot[values] = np.arange(len(values))
    return values.astype(codes.dtype, copy=False), slot[codes]


def capped(per_device: np.ndarray, factor: float = CAP_FACTOR) -> np.ndarray:
    """Return per device the scale that caps it at `factor` times the median device."""
    positive = per_device[per_device > 0]
    if not positive.size:
        return np.ones_like(per_device)
    cap = factor * float(np.median(positive))
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(per_device > cap, cap / per_device, 1.0)


def trim(influence: np.ndarray, k: int, eligible: np.ndarray | None = None) -> np.ndarray:
    """Return a 0/1 weight per device: the k highest and k lowest influences left out.

    Only `eligible` devices (those with anything to count) are ranked and can be left
    out; ties are broken by position, so the result is deterministic.
    """
    keep = np.ones(len(influence), np.float64)
    if k <= 0:
        return keep
    candidates = np.flatnonzero(eligible) if eligible is not None else np.arange(len(influence))
    if not candidates.size:
        return keep
    order = candidates[np.argsort(influence[candidates], kind="stable")]
    keep[order[:k]] = 0.0
    keep[order[-k:]] = 0.0
    return keep


def left_out(devices: Devices, keep: np.ndarray) -> list[str]:
    """Return the ids of the devices a trim left out (for the evidence)."""
    return [devices.ids[i] for i in np.flatnonzero(keep == 0) if i < len(devices)]


def robust_rate(
    devices: Devices, events: str, trials: str, k: int, factor: float = CAP_FACTOR
) -> tuple[float, float, np.ndarray]:
    """Return (events, trials, weights) of a rate after capping and trimming.

    `events` and `trials` are counters (or `install_failures` / `install_outcomes`);
    the weights are each device's scale, 0 for those left out.
    """
    n = devices.per_device(trials)
    e = np.minimum(devices.per_device(events), n)
    scale = capped(n, factor)
    w, x = scale * n, scale * e
    rate = x.sum() / w.sum() if w.sum() > 0 else 0.0
    weights = scale * trim(x - rate * w, k, n > 0)
    return float(weights @ e), float(weights @ n), weights


def comparable_configs(cohorts: Sequence[Devices], k: int) -> list[str]:
    """Return the backend configs each cohort ran on more than 2k devices (sorted).

    Only those are compared like with like: a config fewer devices ran could be one
    device's own (its figures there unchallenged by any other), and the trim could not
    leave it out.
    """
    common = set.intersection(*(set(d.configs_with_devices(2 * k + 1)) for d in cohorts))
    return sorted(common)


def quantile_weights(
    cohorts: Sequence[Devices], q: float, k: int, factor: float = CAP_FACTOR
) -> tuple[list[np.ndarray], list[str]]:
    """Return per cohort device weights for latency quantile `q`, and configs to compare.

    Each device is capped by its timed inferences, then the k devices raising the
    cohort's q-quantile most and the k lowering it most are left out. Influence is
    measured per backend config on the configs every cohort ran on more than 2k devices
    (`comparable_configs`: like with like, as `guardrails.latency_ratio` compares them;
    all configs pooled when there are none, and then the configs returned are empty),
    each config weighted by its sample in every cohort.
    """
    scales = [capped(d.per_device("latency_count"), factor) for d in cohorts]
    shared = set(comparable_configs(cohorts, k))
    pooled = not shared
    out = []
    sizes = [
        {c: _config_samples(d, s, c) for c in (shared or {None})}
        for d, s in zip(cohorts, scales, strict=True)
    ]
    weight = {c: _harmonic([size[c] for size in sizes]) for c in (shared or {None})}
    total = sum(weight.values()) or 1.0
    for devices, scale, size in zip(cohorts, scales, sizes, strict=True):
        configs = [None] if pooled else sorted(shared)
        slots = np.full(max(1, len(devices.configs)), -1, np.intp)
        q_index = np.zeros(len(configs), np.intp)
        share = np.zeros(len(configs))
        entry_scale = scale[devices.entry_device]
        # Each config's histogram as `devices.pooled(scale, config)` sums it, in one pass.
        per_config = (
            None
            if pooled
            else devices.config_buckets(devices.hist_count * entry_scale[devices.hist_entry])
        )
        for slot, config in enumerate(configs):
            if config is None:
                q_index[slot] = _quantile_index(size[config], devices.pooled(scale).buckets, q)
                slots[:] = slot
            elif config in devices.configs:
                at = devices.configs.index(config)
                q_index[slot] = _quantile_index(size[config], per_config[at], q)
                slots[at] = slot
            else:
                q_index[slot] = -1  # as of an empty aggregate
            share[slot] = weight[config] / total / max(size[config], 1e-12)
        entry_slot = slots[devices.entry_config]
        below = devices.below(entry_slot, q_index)
        per_entry = np.where(
            entry_slot >= 0,
            share[np.maximum(entry_slot, 0)] * entry_scale * (q * devices.latency_count - below),
            0.0,
        )
        influence = np.bincount(devices.entry_device, weights=per_entry, minlength=len(devices))
        timed = devices.per_device("latency_count") > 0
        out.append(scale * trim(influence, k, timed))
    return out, sorted(shared)


def _config_samples(devices: Devices, scale: np.ndarray, config: str | None) -> float:
    return devices.timed(scale, config)


def _harmonic(sizes: Sequence[float]) -> float:
    """Return the weight of a config compared across cohorts: n1 * n2 / (n1 + n2)."""
    if any(n <= 0 for n in sizes):
        return 0.0
    if len(sizes) == 1:
        return sizes[0]
    return math.prod(sizes) / sum(sizes)


def _quantile_index(count: float, buckets: np.ndarray, q: float) -> int:
    """Return the bucket holding the nearest-rank q-quantile of `count` samples (-1: none).

    As of an aggregate with that latency count and those buckets (`pooled`'s count is 0
    unless positive).
    """
    if not count > 0:
        return -1
    rank = min(count, max(1, math.ceil(q * count - 1e-9)))
    return int(np.searchsorted(np.cumsum(buckets), rank - 1e-9))
