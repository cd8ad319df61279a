"""Backend recommendations learned from the fleet.

Per model version, variant and device class, the recommended backend config is the one
with the best fleet p50 among those with enough devices and samples whose crash and
fallback rates stay within bounds.

Read from the fleet-wide device rows (one per device and config of a version; devices
silent for `window`, 7 days by default, drop out) and judged on devices, not samples: a
config needs `min_devices` distinct devices left once the `outliers` each way are, each
device's samples are capped at 4 times the median device's, and the `outliers` fastest
and slowest devices are left out before its p50 is read (control_plane.telemetry.robust);
so one device reporting a million fast samples cannot make its config the class's pick.
It is then eligible with at least `min_samples` timed inferences left, at most
`max_crash_rate` crashes and `max_fallback_rate` fallbacks per inference (a fallback
counts against the config whose stats report it; rates capped and trimmed the same way).
Sync answers carry the recommendation for the device's class with its sample size; the
agent tries that config first, and its own golden check still decides whether it serves
(device_agent.install).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from control_plane.store.rollup_records import FLEET, RollupStore
from control_plane.telemetry.classes import DeviceClass, class_values
from control_plane.telemetry.robust import (
    DEFAULT_OUTLIERS,
    Devices,
    quantile_weights,
    robust_rate,
)

WINDOW = dt.timedelta(days=7)
MIN_SAMPLES = 1000
MIN_DEVICES = 3
MAX_CRASH_RATE = 1e-3
MAX_FALLBACK_RATE = 1e-2
CACHE_TTL_S = 60.0
MAX_CACHED = 4096


@dataclass(frozen=True)
class ConfigFigures:
    """One backend config's fleet figures on one device class."""

    config: str
    samples: int  # timed inferences reported (the p50/p95 sample, before capping)
    inferences: int
    devices: int
    p50_us: float | None
    p95_us: float | None
    crash_rate: float | None
    fallback_rate: float | None
    eligible: bool
    why: str = ""  # why not eligible

    def to_dict(self) -> dict:
        """Return the figures, JSON-able."""
        return dict(self.__dict__)


@dataclass(frozen=True)
class ClassBackends:
    """Every config seen on one device class, and the one recommended (if any)."""

    variant: str
    device_class: dict
    configs: tuple[ConfigFigures, ...]
    recommended: str | None

    def to_dict(self) -> dict:
        """Return the table, JSON-able."""
        return {
            "variant": self.variant,
            "device_class": self.device_class,
            "recommended": self.recommended,
            "configs": [c.to_dict() for c in self.configs],
        }


def utcnow() -> dt.datetime:
    """Return the current time, aware UTC."""
    return dt.datetime.now(dt.UTC)


class Stale(LookupError):
    """A `cached_only` question whose answer must be read from the database first."""


class Recommendations:
    """Reads backend tables from the rollups and answers per device (cached)."""

    def __init__(
        self,
        store: RollupStore,
        device_class: DeviceClass,
        *,
        window: dt.timedelta = WINDOW,
        min_samples: int = MIN_SAMPLES,
        max_crash_rate: float = MAX_CRASH_RATE,
        max_fallback_rate: float = MAX_FALLBACK_RATE,
        clock: Callable[[], dt.datetime] = utcnow,
        cache_ttl_s: float = CACHE_TTL_S,
        min_devices: int = MIN_DEVICES,
        outliers: int = DEFAULT_OUTLIERS,
    ) -> None:
        self._store, self._class = store, device_class
        self._window, self._min_samples = window, min_samples
        self._min_devices, self._outliers = min_devices, outliers
        self._max_crash, self._max_fallback = max_crash_rate, max_fallback_rate
        self._clock, self._ttl = clock, cache_ttl_s
        self._lock = threading.Lock()
        self._refresh = threading.Lock()
        self._cache: dict[tuple[str, int], tuple[float, dict]] = {}

    def table(self, model: str, version: int, variant: str | None = None) -> list[ClassBackends]:
        """Return the backend table of a version, per variant and device class."""
        table = self._store.device_table(
            FLEET, model=model, version=version, seen_since=self._clock() - self._window
        )
        groups: dict[tuple[str, str], dict[str, list[int]]] = {}
        for i, (var, device_class, config) in enumerate(
            zip(table.variant, table.device_class, table.config, strict=True)
        ):
            if variant is not None and var != variant:
                continue
            groups.setdefault((var, device_class), {}).setdefault(config, []).append(i)
        out = []
        for (var, device_class), by_config in sorted(groups.items()):
            configs = [
                self._figures(config, Devices(table, np.array(rows, np.intp)))
                for config, rows in by_config.items()
            ]
            configs.sort(key=lambda c: (not c.eligible, c.p50_us or float("inf"), c.config))
            best = configs[0].config if configs and configs[0].eligible else None
            out.append(ClassBackends(var, class_values(device_class), tuple(configs), best))
        return out

    def _figures(self, config: str, devices: Devices) -> ConfigFigures:
        k = self._outliers
        raw = devices.pooled()
        (weights,), _ = quantile_weights([devices], 0.5, k)
        judged = devices.pooled(weights)
        crashes, n, _ = robust_rate(devices, "crashes", "inferences", k)
        fallbacks, n_f, _ = robust_rate(devices, "fallbacks", "inferences", k)
        crash = crashes / n if n else None
        fallback = fallbacks / n_f if n_f else None
        # min_devices left after the trim: so many devices' own figures, whatever k send.
        needed = self._min_devices + 2 * k
        why = ""
        if len(devices) < needed:
            why = f"{len(devices)} of {needed} devices"
        elif judged.latency_count < self._min_samples:
            why = f"{judged.latency_count:.0f} of {self._min_samples} samples"
            if judged.latency_count < raw.latency_count:
                why += f" (of {raw.latency_count} reported; capped, outliers left out)"
        elif crash is not None and crash > self._max_crash:
            why = f"crash rate {crash:.2g} > {self._max_crash:g}"
        elif fallback is not None and fallback > self._max_fallback:
            why = f"fallback rate {fallback:.2g} > {self._max_fallback:g}"
        return ConfigFigures(
            config=config,
            samples=raw.latency_count,
            inferences=raw.inferences,
            devices=len(devices),
            p50_us=judged.quantile_us(0.5),
            p95_us=judged.quantile_us(0.95),
            crash_rate=crash,
            fallback_rate=fallback,
            eligible=not why,
            why=why,
        )

    def for_device(
        self, model: str, version: int, variant: str, attrs: Mapping, *, cached_only=False
    ) -> tuple[str, int] | None:
        """Return (config, samples) recommended for this device's class, or None.

        With `cached_only` (on an event loop), Stale instead of reading the database.
        """
        key = (model, version)
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(key)
        if cached is None or cached[0] < now:
            if cached_only:
                raise Stale(f"{model}:{version}")
            with self._refresh:  # one query per version and minute, however many Syncs
                with self._lock:
                    cached = self._cache.get(key)
                if cached is None or cached[0] < now:
                    cached = self._load(key, now)
        return cached[1].get((variant, _class_key(class_values(self._class.of(attrs)))))

    def _load(self, key: tuple[str, int], now: float) -> tuple[float, dict]:
        model, version = key
        best = {
            (t.variant, _class_key(t.device_class)): next(
                (c.config, c.samples) for c in t.configs if c.config == t.recommended
            )
            for t in self.table(model, version)
            if t.recommended is not None
        }
        cached = (now + self._ttl, best)
        with self._lock:
            self._cache[key] = cached
            while len(self._cache) > MAX_CACHED:
                self._cache.pop(next(iter(self._cache)))
        return cached


def _class_key(values: Mapping) -> tuple:
    return tuple(sorted(values.items()))
