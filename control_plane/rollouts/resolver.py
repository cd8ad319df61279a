"""Desired state, derived on demand: which version of each model a device should run.

Never stored per device. A `Snapshot` holds every rollout that can still assign a version,
with its selector compiled once, grouped by model and sorted in precedence order, so
resolving one device is a few selector checks and hashes. The `Resolver` swaps in a new
snapshot when the fleet revision moves (told by the change feed), so a Sync never reads
rollouts from the database.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from control_plane.fleet.selector import Selector, parse_selector
from control_plane.rollouts.lifecycle import (
    BUCKETS,
    LIVE_STATES,
    RolloutState,
    bucket,
    stage_limit,
)
from control_plane.store.rollouts import RolloutRecord, RolloutStore
from control_plane.telemetry.classes import Dimension, parse_dimension


@dataclass(frozen=True)
class Desired:
    """The version of one model a device should run, and the rollout that says so."""

    version: int
    variant: str
    rollout: str

    def to_dict(self) -> dict:
        """Return the JSON shape `fleet ls` and `sim --json` print."""
        return {"version": self.version, "variant": self.variant, "rollout": self.rollout}


@dataclass(frozen=True)
class LiveRollout:
    """A rollout with its selector compiled and its current stage's bucket limit."""

    record: RolloutRecord
    selector: Selector = field(compare=False)
    limit: int
    desired: Desired
    # Slices a guardrail (or an operator) rolled back: their devices are not selected.
    slice_dimension: Dimension | None = None
    excluded: frozenset[str] = frozenset()

    def selects(self, attrs: Mapping) -> bool:
        """Return whether the rollout applies to a device with these attributes."""
        if not self.selector.matches(attrs):
            return False
        return (
            self.slice_dimension is None or self.slice_dimension.value(attrs) not in self.excluded
        )

    def includes(self, device_id: str) -> bool:
        """Return whether the current stage includes this (selected) device."""
        return self.limit >= BUCKETS or bucket(self.record.id, device_id) < self.limit

    def included_at(self, device_id: str, at: dt.datetime) -> bool:
        """Return whether the stage in effect at `at` included this (selected) device.

        Before the current stage began, the stage before it (before the rollout began,
        none); telemetry is rolled seconds after it is made, but a queued report may
        predate a stage (or two: then it is judged by the one just before).
        """
        record = self.record
        if at >= record.stage_started_at or record.state == RolloutState.COMPLETED:
            return self.includes(device_id)
        if record.stage == 0 or at < record.created_at:
            return False
        return bucket(record.id, device_id) < stage_limit(record.stages, record.stage - 1)


class Snapshot:
    """Every live rollout at one fleet revision, ready to resolve devices against."""

    def __init__(self, revision: int, rollouts: Iterable[LiveRollout]) -> None:
        self.revision = revision
        staged: dict[str, list[LiveRollout]] = {}
        done: dict[str, list[LiveRollout]] = {}
        for r in rollouts:
            if r.record.state not in LIVE_STATES:
                continue  # rolled back: its devices go back to what they had without it
            target = done if r.record.state == RolloutState.COMPLETED else staged
            target.setdefault(r.record.model, []).append(r)
        # Precedence: highest priority, then newest; completed ones newest first.
        for group in staged.values():
            group.sort(key=lambda r: (r.record.priority, r.record.created_at, r.record.id))
            group.reverse()
        for group in done.values():
            group.sort(key=lambda r: (r.record.created_at, r.record.id), reverse=True)
        self._staged, self._done = staged, done
        self.models = tuple(sorted(set(staged) | set(done)))
        self.by_id = {r.record.id: r for r in (*_flat(staged), *_flat(done))}

    def desired_model(
        self, model: str, device_id: str, attrs: Mapping, *, excluding: str = ""
    ) -> Desired | None:
        """Return what `model` should be on this device, or None.

        With `excluding`, as if that rollout were not there.
        """
        for r in self._staged.get(model, ()):
            if r.record.id != excluding and r.selects(attrs) and r.includes(device_id):
                return r.desired
        for r in self._done.get(model, ()):
            if r.record.id != excluding and r.selects(attrs):
                return r.desired
        return None

    def desired(self, device_id: str, attrs: Mapping) -> dict[str, Desired]:
        """Return the desired version of every model that has one for this device."""
        out = {}
        for model in self.models:
            d = self.desired_model(model, device_id, attrs)
            if d is not None:
                out[model] = d
        return out


def _flat(groups: dict[str, list[LiveRollout]]) -> list[LiveRollout]:
    return [r for group in groups.values() for r in group]


class Resolver:
    """Keeps the current snapshot; reloads it lazily after the change feed says so."""

    def __init__(self, store: RolloutStore) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._reload_lock = threading.Lock()
        self._compiled: dict[str, Selector] = {}
        self._snapshot: Snapshot | None = None
        # Bumped by every change; the snapshot is current when it was loaded at the
        # latest generation. (A flag cleared before a reload would let a change that
        # lands during the reload go unseen by whoever asked right after it.)
        self._wanted = 1
        self._loaded = 0

    def invalidate(self, *_args) -> None:
        """Mark the snapshot stale (called by the change feed for every new revision)."""
        with self._lock:
            self._wanted += 1

    def snapshot(self) -> Snapshot:
        """Return a snapshot loaded after the latest change (blocking: may read the DB)."""
        snap = self._snapshot
        if snap is not None and self._loaded == self._wanted:
            return snap
        with self._reload_lock:
            with self._lock:
                generation = self._wanted
            if self._snapshot is None or self._loaded < generation:
                fresh = self._load()
                with self._lock:
                    self._snapshot, self._loaded = fresh, generation
            return self._snapshot

    def _load(self) -> Snapshot:
        # Revision first: data newer than its revision is harmless, the reverse is not.
        revision = self._store.revision()
        records = self._store.list_rollouts(states=tuple(s.value for s in LIVE_STATES))
        return Snapshot(revision, (self.live(r) for r in records))

    def live(self, record: RolloutRecord) -> LiveRollout:
        """Compile one rollout (selectors cached by text across reloads)."""
        selector = self._compiled.get(record.selector)
        if selector is None:
            selector = self._compiled[record.selector] = parse_selector(record.selector)
        completed = record.state == RolloutState.COMPLETED
        limit = BUCKETS if completed else stage_limit(record.stages, record.stage)
        excluded = record.rolled_back_slices()
        dimension = None
        if excluded and record.slice_by:
            dimension = parse_dimension(record.slice_by)
        return LiveRollout(
            record,
            selector,
            limit,
            Desired(record.version, record.variant, record.id),
            dimension,
            excluded,
        )
