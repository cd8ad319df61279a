"""Counters across a simulated fleet: what the live view, the summary and benches read."""

from __future__ import annotations

import collections
from collections.abc import Sequence
from dataclasses import dataclass, field

from control_plane.sim.artifacts import ArtifactCache
from control_plane.sim.device import SimDevice, Target


@dataclass(frozen=True)
class TargetCount:
    """Devices whose desired state holds one version, and how many installed it."""

    desired: int
    installed: int


@dataclass(frozen=True)
class FleetStats:
    """Counters across the simulated fleet at one moment."""

    devices: int
    watching: int
    synced: int
    converged: int  # synced, and runs every version it is assigned
    rejected: int
    syncs: int
    reconnects: int
    downloads: int
    bytes_downloaded: int
    failures: dict[str, int] = field(default_factory=dict)
    targets: dict[Target, TargetCount] = field(default_factory=dict)
    reports: int = 0  # telemetry batches the control plane took
    reports_queued: int = 0  # batches waiting for the control plane
    reports_dropped: int = 0  # batches dropped: queue bounds, or refused as invalid
    enrolling: int = 0  # devices still being enrolled (the live view's first phase)


def fleet_stats(devices: Sequence[SimDevice], cache: ArtifactCache) -> FleetStats:
    """Count what `devices` are doing now."""
    failures: collections.Counter[str] = collections.Counter()
    desired: collections.Counter[Target] = collections.Counter()
    done: collections.Counter[Target] = collections.Counter()
    converged = 0
    for d in devices:
        failures.update(d.failures)
        complete = d.syncs > 0
        for m in d.desired.values():
            t = (m.model, m.version, m.variant)
            ok = d.installed.get(m.model) == (m.version, m.variant)
            desired[t] += 1
            done[t] += ok
            complete = complete and ok
        converged += complete
    return FleetStats(
        devices=len(devices),
        watching=sum(d.watching for d in devices),
        synced=sum(d.syncs > 0 for d in devices),
        converged=converged,
        rejected=sum(bool(d.rejected) for d in devices),
        syncs=sum(d.syncs for d in devices),
        reconnects=sum(d.reconnects for d in devices),
        downloads=cache.downloads,
        bytes_downloaded=cache.bytes_downloaded,
        failures=dict(failures),
        targets={t: TargetCount(n, done[t]) for t, n in sorted(desired.items())},
        reports=sum(d.reports for d in devices),
        reports_queued=sum(len(d.outbox) for d in devices),
        reports_dropped=sum(d.outbox.dropped for d in devices),
    )
