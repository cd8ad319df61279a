"""A rollout's health, and the guard that acts on it: pause, roll back a slice, hold a stage.

The health view of a rollout is its candidate and baseline cohorts' figures over the
current window (since the stage started; for a readmitted slice, since it was readmitted;
where the window has too few baseline devices, as in the last stage, the baseline over
the whole rollout),
per slice of the `slice_by` attribute and over all slices still in, with each halt rule's
verdict (control_plane.rollouts.guardrails). It is read from the rollout's device rows
(one per device, backend config, cohort and window: control_plane.telemetry.roller), so
each device's own figures are there to be capped and trimmed, and cohorts are by
assignment: what a device says it runs never puts it in a cohort. Reports outside both
cohorts are counted (`outside_reports`), never judged.

The guard runs every few seconds on every replica. For each active rollout with rules:

- without `slice_by`, a failing rule pauses the whole rollout;
- with it, a failing slice is rolled back on its own (its devices go back to what they
  run without the rollout) while the others go on;

each recorded as a rollout event with the evidence. A stage advances only when its bake
time has passed and every rule passes with enough sample (`ready`). Actions go through
`Rollouts`, so they take the same transitions and land in the same audit log as an
operator's; two replicas acting at once change the rollout once.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from control_plane.rollouts.guardrails import FAIL, PASS, Cohort, Verdict, judge, parse_rule
from control_plane.rollouts.lifecycle import stage_number
from control_plane.store.rollouts import RolloutRecord
from control_plane.store.rollup_records import BASELINE, CANDIDATE, OUTSIDE, RollupStore
from control_plane.telemetry.classes import DeviceClass, class_values, parse_dimension
from control_plane.telemetry.robust import DEFAULT_OUTLIERS, Devices

log = logging.getLogger(__name__)

ACTIVE, ROLLED_BACK = "active", "rolled_back"


@dataclass(frozen=True)
class SliceHealth:
    """One slice of a rollout (or all of it): cohorts, verdicts, state."""

    name: str  # "soc=sm8450", or "" for the whole rollout
    value: str
    state: str
    since: dt.datetime
    candidate: Cohort
    baseline: Cohort
    verdicts: tuple[Verdict, ...] = ()

    @property
    def failing(self) -> list[Verdict]:
        """Return the rules this slice breaks."""
        return [v for v in self.verdicts if v.status == FAIL]

    @property
    def passed(self) -> bool:
        """Return whether every rule passed with enough sample."""
        return all(v.status == PASS for v in self.verdicts)

    def to_dict(self) -> dict:
        """Return the slice's health, JSON-able."""
        return {
            "slice": self.name,
            "state": self.state,
            "since": self.since.isoformat(),
            "candidate": self.candidate.figures(),
            "baseline": self.baseline.figures(),
            "rules": [v.to_dict() for v in self.verdicts],
        }

    def evidence(self, rollout: RolloutRecord) -> dict:
        """Return what a guardrail action records: rules broken, figures, sample sizes."""
        return {
            "rollout": rollout.id,
            "version": rollout.version,
            "stage": stage_number(rollout.stage),  # numbered from 1, as every surface shows it
            **self.to_dict(),
            "failed": [v.rule for v in self.failing],
        }


@dataclass(frozen=True)
class Health:
    """A rollout's health view."""

    rollout: str
    since: dt.datetime
    overall: SliceHealth
    slices: tuple[SliceHealth, ...] = field(default_factory=tuple)
    # Reports the rollout concerns that fall in neither cohort (a device reporting the
    # version without being assigned it, or what it is not assigned): kept, never judged.
    outside_reports: int = 0
    outside_devices: int = 0

    def to_dict(self) -> dict:
        """Return the health view, JSON-able."""
        return {
            "since": self.since.isoformat(),
            "overall": self.overall.to_dict(),
            "slices": [s.to_dict() for s in self.slices],
            "outside": {"reports": self.outside_reports, "devices": self.outside_devices},
        }


def utcnow() -> dt.datetime:
    """Return the current time, aware UTC."""
    return dt.datetime.now(dt.UTC)


class Guard:
    """Computes health views and applies halt rules to running rollouts."""

    def __init__(
        self,
        store: RollupStore,
        rollouts,  # control_plane.rollouts.service.Rollouts (which imports this module)
        device_class: DeviceClass,
        *,
        clock: Callable[[], dt.datetime] = utcnow,
        outliers: int = DEFAULT_OUTLIERS,
    ) -> None:
        self._store, self._rollouts, self._class = store, rollouts, device_class
        self._clock, self._outliers = clock, outliers

    # -- health --------------------------------------------------------------------------

    def health(self, record: RolloutRecord) -> Health:
        """Return the rollout's health over its current window."""
        since = record.stage_started_at
        dimension = parse_dimension(record.slice_by) if record.slice_by else None
        rules = [parse_rule(t) for t in record.halt_rules]
        # The current window's candidate and baseline rows (the outside cohort is not
        # compared, its totals are read below; so the index reads this window's rows
        # alone); older ones (the baseline's only) if a window's own baseline is too thin
        # to judge against: see `cohorts`.
        table = self._store.device_table(
            record.id, windows_since=since, cohorts=(CANDIDATE, BASELINE), lean=True
        )
        older: list = []
        codes: dict[str, int] = {}  # slice value -> its code
        class_code: dict[str, int] = {}  # device class -> its slice's code

        def slice_codes(classes: np.ndarray) -> np.ndarray:
            """Return per row the code of its slice (each distinct class parsed once)."""
            for device_class in dict.fromkeys(classes):
                if device_class not in class_code:
                    value = dimension.value(class_values(device_class)) if dimension else ""
                    class_code[device_class] = codes.setdefault(value, len(codes))
            return np.fromiter(map(class_code.__getitem__, classes), np.intp, len(classes))

        made: dict[bytes, Cohort] = {}

        def cohort_of(positions: np.ndarray) -> Cohort:
            """Return the cohort of some rows, made once per view (each is asked 2-3 times).

            Rows only ever join `table` at its end, so positions read earlier name the same
            rows in any later `table`.
            """
            key = np.asarray(positions, np.intp).tobytes()
            found = made.get(key)
            if found is None:
                found = made[key] = Cohort(Devices(table, positions))
            return found

        sliced = slice_codes(table.device_class)
        kinds = {c: table.cohort == c for c in (CANDIDATE, BASELINE)}
        value_of = dict(map(reversed, codes.items()))
        # Slices the rollout's own devices report in (the table holds no outside rows).
        inside = sorted(value_of[code] for code in np.unique(sliced))
        slice_masks = {v: sliced == codes[v] for v in inside}

        def cohorts(value: str, window: dt.datetime) -> dict[str, np.ndarray]:
            """Return cohort -> positions of the slice's rows in the window."""
            nonlocal table, sliced, kinds, slice_masks
            mine = slice_masks.get(value)
            if mine is None:
                return {}
            recent = table.window >= window.timestamp()
            current = {c: np.flatnonzero(mine & kind & recent) for c, kind in kinds.items()}
            # The last stage leaves no baseline (every selected device is a candidate), and
            # an early one (or a readmitted slice's window) may have too little: then the
            # candidates are compared with the slice's baseline over the whole rollout (what
            # those devices ran before the rollout reached them, or while their slice was
            # rolled back).
            base = cohort_of(current[BASELINE])
            sample = min(base.aggregate.inferences, base.aggregate.latency_count)
            enough = base.devices >= max(1, record.min_devices, 2 * self._outliers + 1)
            if window <= record.created_at or (enough and sample >= max(1, record.min_inferences)):
                return current
            if not older:  # read once, appended: positions read so far stay valid
                older.append(
                    self._store.device_table(
                        record.id, windows_before=since, cohorts=(BASELINE,), lean=True
                    )
                )
                table = table.concat(older[0])
                sliced = np.concatenate([sliced, slice_codes(older[0].device_class)])
                kinds = {c: table.cohort == c for c in (CANDIDATE, BASELINE)}
                slice_masks = {v: sliced == codes[v] for v in slice_masks}
            current[BASELINE] = np.flatnonzero(slice_masks[value] & kinds[BASELINE])
            return current

        slices: list[SliceHealth] = []
        for value in sorted(set(slice_masks) | set(record.slices)) if dimension else ():
            state = record.slices.get(value, {})
            slice_since = since
            readmitted = state.get("state", ACTIVE) == ACTIVE and state.get("since")
            if readmitted and dt.datetime.fromisoformat(state["since"]) > since:
                # Strict: not a second of what the slice's candidates reported before it
                # was readmitted (its baseline may come from the whole rollout, as above).
                slice_since = dt.datetime.fromisoformat(state["since"])
            mine = cohorts(value, slice_since)  # first: it may read older rows into `table`
            slices.append(
                self._slice(
                    record,
                    rules,
                    f"{dimension.name}={value}",
                    value,
                    state.get("state", ACTIVE),
                    slice_since,
                    mine,
                    cohort_of,
                )
            )
        # The whole rollout: every slice still in.
        out = record.rolled_back_slices()
        merged: dict[str, list[np.ndarray]] = {}
        for value in inside:
            if value in out:
                continue
            for cohort, positions in cohorts(value, since).items():
                merged.setdefault(cohort, []).append(positions)
        overall = self._slice(
            record,
            rules,
            "",
            "",
            record.state,
            since,
            # In row order, whatever the slices' order: the same rows, the same view.
            {c: np.sort(np.concatenate(parts)) for c, parts in merged.items()},
            cohort_of,
        )
        reports, devices = self._store.cohort_totals(record.id, OUTSIDE)
        return Health(
            record.id,
            since,
            overall,
            tuple(slices),
            outside_reports=reports,
            outside_devices=devices,
        )

    def _slice(self, record, rules, name, value, state, since, cohorts, cohort_of) -> SliceHealth:
        empty = np.zeros(0, np.intp)
        candidate = cohort_of(cohorts.get(CANDIDATE, empty))
        baseline = cohort_of(cohorts.get(BASELINE, empty))
        verdicts = tuple(
            judge(
                rule,
                candidate,
                baseline,
                min_devices=record.min_devices,
                min_inferences=record.min_inferences,
                outliers=self._outliers,
            )
            for rule in rules
        )
        return SliceHealth(name, value, state, since, candidate, baseline, verdicts)

    # -- acting --------------------------------------------------------------------------

    def ready(self, record: RolloutRecord) -> bool:
        """Return whether the rollout's rules let its stage advance."""
        if not record.halt_rules:
            return True
        health = self.health(record)
        if any(s.failing for s in health.slices if s.state == ACTIVE):
            return False
        return health.overall.passed

    def check(self) -> list[str]:
        """Apply every active rollout's rules once; return what was done, for the log."""
        done: list[str] = []
        for record in self._rollouts.list_active_with_rules():
            try:
                done.extend(self._check_one(record))
            except Exception:  # noqa: BLE001 - one rollout's trouble must not stop the rest
                log.exception("guardrail check of rollout %s failed", record.id)
        for line in done:
            log.warning("%s", line)
        return done

    def _check_one(self, record: RolloutRecord) -> list[str]:
        health = self.health(record)
        if not record.slice_by:
            failing = health.overall.failing
            if not failing:
                return []
            reason = "guardrail: " + "; ".join(v.detail for v in failing)
            changed = self._rollouts.halt(
                record, reason=reason, evidence=health.overall.evidence(record)
            )
            return [f"{record.id}: paused ({reason})"] if changed else []
        done = []
        for s in health.slices:
            if s.state != ACTIVE or not s.failing:
                continue
            reason = f"guardrail: {s.name}: " + "; ".join(v.detail for v in s.failing)
            changed = self._rollouts.set_slice(
                record.id,
                s.value,
                ROLLED_BACK,
                actor="guardrail",
                reason=reason,
                evidence=s.evidence(record),
                # Only if nobody touched the slice since this health view was read: an
                # operator's readmission meanwhile starts a new window.
                expected=record.slices.get(s.value, {}),
            )
            if changed is not None:
                done.append(f"{record.id}: slice {s.name} rolled back ({reason})")
        return done
