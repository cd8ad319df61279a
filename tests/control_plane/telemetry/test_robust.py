"""Pooling a group of devices: the one-pass readings give `pooled`'s figures to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane.store.rollup_aggregate import Aggregate
from control_plane.store.rollup_records import EPOCH, DeviceKey, DeviceRollup
from control_plane.telemetry.robust import Devices, capped, quantile_weights
from runtime.histogram import LatencyHistogram

CONFIGS = ("CPU/normal/t2/mem-normal", "OPENCL/low/t4/mem-normal", "NPU/high/t1/mem-low")


def _histogram(rng, median_ns: float, n: int, times: int = 1) -> Aggregate:
    h = LatencyHistogram()
    h.record_many_ns(rng.lognormal(np.log(median_ns), 0.5, n))
    agg = Aggregate()
    agg.buckets = h.counts.astype(np.int64) * int(rng.integers(1, 40)) * times
    agg._add_latency(int(agg.buckets.sum()), int(agg.buckets.sum()) * 2_000_000, h.min_ns, h.max_ns)
    return agg


def _devices(seed: int, *, ttft: bool) -> Devices:
    """Devices of unequal size (some capped) on several configs, some rows untimed."""
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(60):
        for config in CONFIGS:
            if rng.random() < 0.3:
                continue
            timed = rng.random() > 0.1
            heavy = 100 if i % 17 == 0 else 1
            agg = _histogram(rng, 2e6, int(rng.integers(20, 300)), heavy) if timed else Aggregate()
            agg.inferences = agg.latency_count + 3
            agg.crashes, agg.errors = int(rng.integers(0, 4)), int(rng.integers(0, 9))
            if agg.crashes:
                agg.crash_signals["SIGSEGV"] = agg.crashes
            if ttft and timed:
                agg.ttft = _histogram(rng, 3e7, 30)
            key = DeviceKey("ro_1", EPOCH, "candidate", "m", 1, "fp32", config, f"dev_{i:04d}")
            rows.append(DeviceRollup.of(key, agg))
    rng.shuffle(rows)
    return Devices.of(rows)


def _same(a: Aggregate, b: Aggregate) -> None:
    """Assert two aggregates hold the same figures, floats to the bit."""
    assert type(a.latency_count) is type(b.latency_count)
    assert vars(a).keys() == vars(b).keys()
    for name, value in vars(a).items():
        other = getattr(b, name)
        if name == "ttft":
            assert (value is None) == (other is None)
            if value is not None:
                _same(value, other)
        elif isinstance(value, np.ndarray):
            assert value.dtype == other.dtype and value.tobytes() == other.tobytes(), name
        else:
            assert repr(value) == repr(other), name


@pytest.mark.parametrize("ttft", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pooling_every_config_at_once_gives_each_configs_own_pooling(seed, ttft):
    devices = _devices(seed, ttft=ttft)
    scale = capped(devices.per_device("latency_count"))
    assert (scale < 1).any()  # some devices are capped: the weights are not whole numbers
    (trimmed,), _ = quantile_weights([devices], 0.95, 2)
    for weights in (None, scale, trimmed):
        whole, per_config = devices.pooled_all(weights)
        _same(whole, devices.pooled(weights))
        assert list(per_config) == devices.configs
        for config, agg in per_config.items():
            _same(agg, devices.pooled(weights, config))
        for config, agg in devices.by_config(weights).items():
            _same(agg, devices.pooled(weights, config))
