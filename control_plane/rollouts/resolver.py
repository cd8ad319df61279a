"""Desired state, derived on demand: which version of each model a device should run.

Never stored per device. A `Snapshot` holds every rollout that can still assign a version,
with its selector compiled once, grouped by model and sorted in precedence order, so
resolving one device is a few selector checks and hashes. The `Resolver` swaps in a new
snapshot when the fleet revision moves (told by the change feed), so a Sync never reads
rollouts from the database.

The same snapshot places each telemetry report in a rollout's cohorts by assignment
(`Snapshot.placements`): the roller (control_plane.telemetry.roller) asks, and adds the
figures where it is told.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from control_plane.fleet.selector import Selector, parse_selector
from control_plane.rollouts import download_policy
from control_plane.rollouts.fit import misfit
from control_plane.rollouts.lifecycle import (
    BUCKETS,
    LIVE_STATES,
    RolloutState,
    bucket,
    stage_limit,
)
from control_plane.store.rollouts import RolloutRecord, RolloutStore
from control_plane.store.rollup_records import BASELINE, CANDIDATE, OUTSIDE
from control_plane.telemetry.classes import Dimension, parse_dimension
from control_plane.telemetry.roller import Placement


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
    # What the variant needs of a device (control_plane.rollouts.fit); {}: nothing.
    needs: Mapping = field(default_factory=dict, compare=False)

    def selects(self, attrs: Mapping) -> bool:
        """Return whether the rollout applies to a device with these attributes."""
        if not self.selector.matches(attrs):
            return False
        return (
            self.slice_dimension is None or self.slice_dimension.value(attrs) not in self.excluded
        )

    def misfit(self, attrs: Mapping) -> tuple[str, str] | None:
        """Return why a selected device cannot run the variant (None: it fits)."""
        return misfit(self.needs, attrs) if self.needs else None

    def waits(self, attrs: Mapping) -> tuple[str, str] | None:
        """Return what a device must wait for before it may download (None: nothing)."""
        record = self.record
        if record.download_on == "any" and record.download_while == "any":
            return None
        return download_policy.waits(record.download_on, record.download_while, attrs)

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
        # A rollout whose variant the device cannot run is passed over: the device keeps
        # what it would have had without it.
        for r in self._staged.get(model, ()):
            if (
                r.record.id != excluding
                and r.selects(attrs)
                and r.includes(device_id)
                and r.misfit(attrs) is None
                and r.waits(attrs) is None
            ):
                return r.desired
        for r in self._done.get(model, ()):
            if (
                r.record.id != excluding
                and r.selects(attrs)
                and r.misfit(attrs) is None
                and r.waits(attrs) is None
            ):
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

    def placements(
        self,
        model: str,
        device_id: str,
        attrs: Mapping,
        version: int,
        variant: str,
        at: dt.datetime,
    ) -> list[Placement]:
        """Return where a report of `model` made `at` counts in each staged rollout of it.

        The roller's question (control_plane.telemetry.roller.Cohorts): one placement per
        active or paused rollout of the model that the report concerns (`cohort_of`).
        """
        out = []
        for r in self._staged.get(model, ()):
            cohort = self.cohort_of(r, device_id, attrs, version, variant, at)
            if cohort is None:
                continue
            window = window_of(r.record, _slice_value(r, attrs), at)
            out.append(Placement(r.record.id, cohort, _slice_class(r, attrs), window))
        return out

    def cohort_of(
        self,
        rollout: LiveRollout,
        device_id: str,
        attrs: Mapping,
        version: int,
        variant: str,
        at: dt.datetime,
    ) -> str | None:
        """Return which cohort of a rollout a device's report of `version`, made `at`, is in.

        By assignment, never by what the device says it runs: the **candidate** cohort is
        the devices the control plane assigned the rollout's version under this rollout
        (selected, in the current stage, their slice not rolled back, and no rollout of
        higher precedence deciding for them) reporting that version; the **baseline** is
        the devices the rollout selects but does not include (not in the stage yet, or
        their slice rolled back) reporting what they are assigned without it. Anything
        else a selected device reports, and any report of the rollout's version from
        elsewhere, is OUTSIDE: stored and counted, never judged. None: the report has
        nothing to do with the rollout.

        The stage is the one in effect when the report was made (`LiveRollout.included_at`);
        the rest of the assignment is today's.
        """
        record = rollout.record
        reported = (version, variant)
        if not rollout.selector.matches(attrs):
            return OUTSIDE if reported == (record.version, record.variant) else None
        if rollout.selects(attrs) and rollout.included_at(device_id, at):
            desired = self.desired_model(record.model, device_id, attrs)
            assigned = desired is not None and desired.rollout == record.id
            if assigned and reported == (record.version, record.variant):
                return CANDIDATE
            return OUTSIDE
        without = self.desired_model(record.model, device_id, attrs, excluding=record.id)
        if without is not None and reported == (without.version, without.variant):
            return BASELINE
        return OUTSIDE


def _flat(groups: dict[str, list[LiveRollout]]) -> list[LiveRollout]:
    return [r for group in groups.values() for r in group]


def window_of(record: RolloutRecord, slice_value: str | None, at: dt.datetime) -> dt.datetime:
    """Return the start of the window a report made `at` counts in, for guardrails.

    The window is the current stage's, or the device's slice's since it was readmitted or
    rolled back, whichever began last; a report from before it (late, or queued through
    an outage) counts only in the whole rollout's figures, under the rollout's start.
    """
    start = window_start(record, slice_value)
    return start if at >= start else record.created_at


def window_start(record: RolloutRecord, slice_value: str | None) -> dt.datetime:
    """Return when the window of a slice (or of the whole rollout, None) began."""
    start = record.stage_started_at
    state = record.slices.get(slice_value) if slice_value is not None else None
    if state and state.get("since"):
        start = max(start, dt.datetime.fromisoformat(state["since"]))
    return start


def _slice_value(rollout: LiveRollout, attrs) -> str | None:
    spec = rollout.record.slice_by
    return parse_dimension(spec).value(attrs) if spec else None


def _slice_class(rollout: LiveRollout, attrs) -> str:
    """Return the class a rollout's rows keep for a device: its slice attribute, or none."""
    spec = rollout.record.slice_by
    if not spec:
        return "{}"
    dim = parse_dimension(spec)
    return json.dumps({dim.name: dim.value(attrs)}, ensure_ascii=False)


class Resolver:
    """Keeps the current snapshot; reloads it lazily after the change feed says so."""

    def __init__(
        self, store: RolloutStore, needs: Callable[[str, int, str], Mapping] | None = None
    ) -> None:
        """`needs(model, version, variant)` says what a variant needs of a device."""
        self._store = store
        self._needs = needs or (lambda *_: {})
        self._needs_cache: dict[tuple[str, int, str], Mapping] = {}  # versions are immutable
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

    def current(self) -> Snapshot | None:
        """Return the snapshot if it is loaded after the latest change, else None (no I/O)."""
        snap = self._snapshot
        return snap if snap is not None and self._loaded == self._wanted else None

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
        key = (record.model, record.version, record.variant)
        needs = self._needs_cache.get(key)
        if needs is None:
            needs = self._needs_cache[key] = self._needs(*key)
        return LiveRollout(
            record,
            selector,
            limit,
            Desired(record.version, record.variant, record.id),
            dimension,
            excluded,
            needs,
        )
