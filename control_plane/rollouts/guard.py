"""A rollout's health, and the guard that acts on it: pause, roll back a slice, hold a stage.

The health view of a rollout is its candidate and baseline cohorts' figures over the
current window (since the stage started; for a readmitted slice, since it was readmitted;
where the window has too few baseline devices, as in the last stage, the baseline over
the whole rollout),
per slice of the `slice_by` attribute and over all slices still in, with each halt rule's
verdict (control_plane.rollouts.guardrails). It is read from the rollups: whole hours from
1-hour rows, the window's first partial hour from 1-minute rows.

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

from control_plane.rollouts.guardrails import FAIL, PASS, Cohort, Verdict, judge, parse_rule
from control_plane.store.rollouts import RolloutRecord
from control_plane.store.rollups import Aggregate, RollupKey, RollupStore
from control_plane.telemetry.classes import DeviceClass, class_values, parse_dimension
from control_plane.telemetry.rollups import BASELINE, CANDIDATE, Retention, window_parts

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
            "stage": rollout.stage,
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

    def to_dict(self) -> dict:
        """Return the health view, JSON-able."""
        return {
            "since": self.since.isoformat(),
            "overall": self.overall.to_dict(),
            "slices": [s.to_dict() for s in self.slices],
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
        retention: Retention | None = None,
        clock: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self._store, self._rollouts, self._class = store, rollouts, device_class
        self._retention, self._clock = retention or Retention(), clock

    # -- health --------------------------------------------------------------------------

    def health(self, record: RolloutRecord) -> Health:
        """Return the rollout's health over its current window."""
        now = self._clock()
        since = record.stage_started_at
        dimension = parse_dimension(record.slice_by) if record.slice_by else None
        rules = [parse_rule(t) for t in record.halt_rules]

        def slice_of(device_class: str) -> str:
            return dimension.value(class_values(device_class)) if dimension else ""

        groups = self._cohorts(record.id, since, now, slice_of)
        # The last stage leaves no baseline (every selected device is a candidate), and an
        # early one (or a readmitted slice's window) may have too little: then candidates
        # are compared with the baseline over the whole rollout (what those devices ran
        # before the rollout reached them, or while their slice was rolled back).
        whole: list[dict] = []  # the whole rollout's cohorts, read once if needed

        def fill_baseline(value: str, cohorts: dict, window_start: dt.datetime) -> None:
            if window_start <= record.created_at:
                return
            agg, devices, *_ = cohorts.get(BASELINE, (Aggregate(), 0))
            # As `judge` counts: inferences for rates, timed ones (no errors) for latency.
            sample = min(agg.inferences, agg.latency_count)
            if devices >= max(1, record.min_devices) and sample >= max(1, record.min_inferences):
                return
            if not whole:
                whole.append(self._cohorts(record.id, record.created_at, now, slice_of))
            before = whole[0].get(value, {}).get(BASELINE)
            if before is not None:
                cohorts[BASELINE] = before

        for value, cohorts in groups.items():
            fill_baseline(value, cohorts, since)
        values = set(groups) | set(record.slices)
        slices: list[SliceHealth] = []
        for value in sorted(values) if dimension else ():
            state = record.slices.get(value, {})
            slice_since = since
            readmitted = state.get("state", ACTIVE) == ACTIVE and state.get("since")
            if readmitted and dt.datetime.fromisoformat(state["since"]) > since:
                slice_since = dt.datetime.fromisoformat(state["since"])
                # Strict: not a second of what the slice's candidates reported before it
                # was readmitted (its baseline may come from the whole rollout, as above).
                cohorts = self._cohorts(record.id, slice_since, now, slice_of, strict=True).get(
                    value, {}
                )
                fill_baseline(value, cohorts, slice_since)
            else:
                cohorts = groups.get(value, {})
            slices.append(
                self._slice(
                    record,
                    rules,
                    f"{dimension.name}={value}",
                    value,
                    state.get("state", ACTIVE),
                    slice_since,
                    cohorts,
                )
            )
        # The whole rollout: every slice still in.
        merged: dict[str, list] = {}
        out = record.rolled_back_slices()
        for value, cohorts in groups.items():
            if value in out:
                continue
            for cohort, (agg, devices, affected, by_config) in cohorts.items():
                total = merged.setdefault(cohort, [Aggregate(), 0, {}, {}])
                total[0].merge(agg)
                total[1] += devices
                for kind, k in affected.items():
                    total[2][kind] = total[2].get(kind, 0) + k
                for config, part in by_config.items():
                    total[3].setdefault(config, Aggregate()).merge(part)
        overall = self._slice(
            record,
            rules,
            "",
            "",
            record.state,
            since,
            {k: tuple(v) for k, v in merged.items()},
        )
        return Health(record.id, since, overall, tuple(slices))

    def _slice(self, record, rules, name, value, state, since, cohorts) -> SliceHealth:
        candidate = Cohort(*cohorts.get(CANDIDATE, (Aggregate(), 0, {}, {})))
        baseline = Cohort(*cohorts.get(BASELINE, (Aggregate(), 0, {}, {})))
        verdicts = tuple(
            judge(
                rule,
                candidate,
                baseline,
                min_devices=record.min_devices,
                min_inferences=record.min_inferences,
            )
            for rule in rules
        )
        return SliceHealth(name, value, state, since, candidate, baseline, verdicts)

    def _cohorts(
        self,
        rollout_id: str,
        since: dt.datetime,
        now: dt.datetime,
        slice_of,
        *,
        strict: bool = False,
    ) -> dict[str, dict[str, tuple]]:
        """Return slice value -> cohort -> (aggregate, devices, affected, by config)."""
        memo: dict[str, str] = {}

        def group(_at: dt.datetime, key: RollupKey):
            value = memo.get(key.device_class)
            if value is None:
                value = memo[key.device_class] = slice_of(key.device_class)
            return value, key.cohort, key.config

        parts = [
            self._store.merged_rollups(
                resolution_s=res, since=start, until=until, rollout=rollout_id, group=group
            )
            for res, start, until in window_parts(since, now, self._retention, strict=strict)
        ]
        out: dict[str, dict[str, tuple]] = {}
        for part in parts:
            for (value, cohort, config), agg in part.items():
                slot = out.setdefault(value, {})
                merged, _, _, by_config = slot.setdefault(cohort, (Aggregate(), 0, {}, {}))
                merged.merge(agg)
                by_config.setdefault(config, Aggregate()).merge(agg)
        counts = self._store.cohort_device_counts(rollout_id, since=since)
        for cohort, device_class, n, with_incidents in counts:
            value = slice_of(device_class)
            agg, devices, affected, by_config = out.setdefault(value, {}).get(
                cohort, (Aggregate(), 0, {}, {})
            )
            affected = dict(affected)
            for kind, k in with_incidents.items():
                affected[kind] = affected.get(kind, 0) + k
            out[value][cohort] = (agg, devices + n, affected, by_config)
        return out

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
