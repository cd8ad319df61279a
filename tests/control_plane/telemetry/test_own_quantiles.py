"""Each device's own quantile read from its row equals the one merged per device, to the bit."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from control_plane.store.rollup_aggregate import Aggregate
from control_plane.store.rollup_records import EPOCH, DeviceKey, DeviceRollup
from control_plane.telemetry import own_quantiles
from control_plane.telemetry.robust import Devices, device_quantiles
from runtime.histogram import N_BUCKETS

Q = (0.5, 0.95, 0.99)


def _row(device: str, config: str, window: int, rng, *, buckets=None) -> DeviceRollup:
    agg = Aggregate(inferences=50)
    n = int(rng.integers(0, 6))  # some devices too few to have a quantile, some none
    if buckets is None:
        buckets = np.zeros(N_BUCKETS, np.int64)
        where = rng.integers(0, N_BUCKETS, int(rng.integers(1, 12)))
        buckets[where] = rng.integers(1, 3 * n + 2, len(where))
        buckets[0 if n == 1 else N_BUCKETS - 1] += n == 1 or n == 2  # under- and overflow
    if n:
        count = int(buckets.sum())
        low, high = (None, None) if n == 3 else (1000 * (1 + n), 10**9 * n)
        agg._add_latency(count, count * 1000, low, high)
        agg.buckets = buckets
    window_start = EPOCH + dt.timedelta(days=window)
    return DeviceRollup.of(DeviceKey("ro", window_start, "c", "m", 1, "v", config, device), agg)


def _merged(devices: Devices, q: float, config: str | None):
    """device_quantiles with every device's rows merged (the reading before rows were)."""
    original = own_quantiles._from_rows
    own_quantiles._from_rows = lambda *_: None
    try:
        return own_quantiles._device_quantiles(devices, q, config)
    finally:
        own_quantiles._from_rows = original


def _same(a, b) -> None:
    for name in ("positions", "log_us", "samples"):
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), name


@pytest.mark.parametrize("seed", range(6))
def test_a_devices_quantile_read_from_its_row_is_the_merged_one(seed):
    rng = np.random.default_rng(seed)
    rows = [
        _row(f"d{i}", config, window, rng)
        for i in range(40)
        for config in ("CPU", "GPU")
        if rng.random() < 0.8
        for window in ((0, 1) if i % 7 == 0 else (0,))  # a few devices with two rows
    ]
    order = rng.permutation(len(rows))
    devices = Devices.of([rows[i] for i in order])
    taken = {"rows": 0}
    original = own_quantiles._from_rows

    def counted(*args):
        found = original(*args)
        taken["rows"] += found is not None
        return found

    own_quantiles._from_rows = counted
    try:
        for q in Q:
            for config in ("CPU", "GPU", None):
                _same(device_quantiles(devices, q, config), _merged(devices, q, config))
                # Some of a table's rows, as a slice's cohort: the table's reading serves it.
                some = np.flatnonzero(rng.random(len(rows)) < 0.5)
                part = Devices(devices.table, some)
                _same(device_quantiles(part, q, config), _merged(part, q, config))
    finally:
        own_quantiles._from_rows = original
    assert taken["rows"]  # one row per device on some: read from rows


def test_counts_too_large_to_add_exactly_are_merged_per_device():
    rng = np.random.default_rng(1)
    buckets = np.zeros(N_BUCKETS, np.int64)
    buckets[[40, 41]] = [2**53, 3]
    rows = [_row(f"d{i}", "CPU", 0, rng, buckets=buckets.copy()) for i in range(5)]
    devices = Devices.of(rows)
    assert own_quantiles._row_quantiles(devices.table, 0.5) is None
    _same(device_quantiles(devices, 0.5, "CPU"), _merged(devices, 0.5, "CPU"))
