"""The design effect: one pass over every config gives each config's own, to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane.telemetry.design_effect import _LOG_MID, _design_effect, design_effects
from control_plane.telemetry.robust import Devices, quantile_weights
from tests.control_plane.telemetry.test_robust import _devices


def _one_design_effect(devices: Devices, weights: np.ndarray, config: str | None) -> float:
    """The design effect on one config, its histogram read on its own (the reference)."""
    entries = np.ones(len(devices.positions), bool)
    if config is not None:
        entries = devices.entry_config == devices.configs.index(config)
    per_hist = (weights[devices.entry_device] * entries)[devices.hist_entry]
    keep = per_hist > 0
    owner = devices.entry_device[devices.hist_entry[keep]]
    counts = devices.hist_count[keep] * per_hist[keep]
    logs = _LOG_MID[devices.hist_index[keep]]
    sums = [np.bincount(owner, weights=w, minlength=len(devices)) for w in (counts, counts * logs)]
    square = np.bincount(owner, weights=counts * logs * logs, minlength=len(devices))
    return _design_effect(sums[0], sums[1], square)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_design_effects_of_every_config_at_once_are_each_configs_own(seed):
    devices = _devices(seed, ttft=False)
    (weights,), _ = quantile_weights([devices], 0.95, 2)
    configs = [None, *devices.configs, "GPU/none"]
    got = design_effects(devices, weights, configs)
    assert list(got) == configs and got["GPU/none"] == 1.0
    for config in configs[:-1]:
        assert repr(got[config]) == repr(_one_design_effect(devices, weights, config))
    assert any(d > 1 for d in got.values())  # the devices differ: something to measure
