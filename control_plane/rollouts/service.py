"""Rollouts as operators drive them: create, list, show (with counts), transitions.

Every change goes through the one transition table (`lifecycle.next_step`) and is written
with its audit entry and a revision bump in one conditional update, so two replicas (or an
operator and the scheduler) racing on one rollout cannot both win.
"""

from __future__ import annotations

import datetime as dt
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from contract import errors
from contract.limits import MAX_ATTRIBUTE, MAX_REASON, check_text
from control_plane.fleet.selector import Selector, parse_selector
from control_plane.registry.accuracy_bars import failed_bars
from control_plane.registry.contract import default_variant
from control_plane.registry.requests import MAX_VERSION, VARIANT_NAME, validate_name
from control_plane.rollouts import download_policy
from control_plane.rollouts.guardrails import BASELINE_METRICS, LLM_METRICS, parse_rules
from control_plane.rollouts.lifecycle import (
    MAX_BAKE_S,
    MAX_PRIORITY,
    Action,
    RolloutState,
    next_step,
    parse_stages,
    stage_text,
)
from control_plane.rollouts.preview import Preview, preview
from control_plane.rollouts.resolver import Resolver
from control_plane.store.base import RegistryStore, VariantRecord, chunk_sizes
from control_plane.store.fleet import FleetStore
from control_plane.store.rollouts import (
    RolloutChange,
    RolloutEventRecord,
    RolloutRecord,
    RolloutStore,
)
from control_plane.telemetry.classes import (
    DEFAULT_DEVICE_CLASS,
    DeviceClass,
    parse_device_class,
    parse_dimension,
)

log = logging.getLogger(__name__)

ROLLOUT_PREFIX = "ro_"


@dataclass(frozen=True)
class RolloutSpec:
    """What an operator asks for when creating a rollout."""

    model: str
    version: int
    variant: str = ""
    selector: str = ""
    stages: tuple[float, ...] = ()
    bake_s: int = 0
    priority: int = 0
    reason: str = ""
    halt_rules: tuple[str, ...] = ()
    min_devices: int = 0
    min_inferences: int = 0
    slice_by: str = ""
    # When devices may fetch it: "any" | "wifi", "any" | "charging" ("" = "any").
    download_on: str = ""
    download_while: str = ""
    # A selector (other than the whole fleet) that matches no device today is refused
    # as a likely typo unless this says the operator means it.
    allow_empty: bool = False
    # A variant the registry kept marked degraded is refused unless this says so.
    allow_degraded: bool = False


# A rollout created without a minimum sample gets these (one device must not decide).
DEFAULT_MIN_DEVICES = 50
DEFAULT_MIN_INFERENCES = 1000
MAX_MIN_DEVICES = 10_000_000
MAX_MIN_INFERENCES = 1 << 40
GUARDRAIL = "guardrail"
_VARIANT_CACHE = 1024  # versions are immutable: a variant's degraded flag never changes
DELTA_VERSIONS = 3  # earlier versions `rollout show` gives a download size from


@dataclass(frozen=True)
class Counts:
    """How far a rollout has got through the fleet."""

    selected: int
    in_stage: int
    synced: int
    installed: int
    failed: int = 0  # devices whose telemetry says this version failed or was rolled back
    # Selected devices that cannot run the variant (control_plane.rollouts.fit), by reason.
    ineligible: int = 0
    ineligible_reasons: dict[str, int] = field(default_factory=dict)
    # Selected devices in the stage that wait for Wi-Fi or a charger, by reason.
    waiting: int = 0
    waiting_reasons: dict[str, int] = field(default_factory=dict)


def utcnow() -> dt.datetime:
    """Return the current time, aware UTC."""
    return dt.datetime.now(dt.UTC)


def _check_reason(reason: str) -> str:
    return check_text("reason", reason, MAX_REASON)


def degraded_reason(variant: VariantRecord) -> str:
    """Say which accuracy bars a degraded variant missed ("cosine 0.4200 with fp32, ...")."""
    failed = failed_bars(variant.accuracy)
    return "; ".join(bar.text() for bar in failed) or "below the accuracy bar"


class Rollouts:
    """The rollout domain over the store; transport-free."""

    def __init__(
        self,
        store: RolloutStore | FleetStore | RegistryStore,
        resolver: Resolver,
        *,
        device_class: DeviceClass | None = None,
        clock: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self._store, self._resolver, self._clock = store, resolver, clock
        self._class = device_class or parse_device_class(DEFAULT_DEVICE_CLASS)
        self._variants: dict[tuple[str, int, str], VariantRecord | None] = {}
        self._downloads: dict[tuple[str, int, str], tuple[int, dict[int, int]]] = {}

    def create(self, spec: RolloutSpec, *, actor: str) -> RolloutRecord:
        """Validate and store a new active rollout at its first stage."""
        record, event, selector = self._validated(spec, actor)
        if str(selector) and not spec.allow_empty:
            self._refuse_empty(selector)
        created = self._store.create_rollout(record, event)
        log.info(
            "rollout %s created: %s:%d to %r", created.id, spec.model, spec.version, str(selector)
        )
        return created

    def preview(self, spec: RolloutSpec, *, actor: str) -> tuple[RolloutRecord, Preview]:
        """Validate `spec` as `create` would and count what it would select; store nothing.

        Returns the rollout as it would be created (its id drawn, never stored) and the
        devices it would select per stage and, sliced, per slice.
        """
        record, _, selector = self._validated(spec, actor)
        dimension = parse_dimension(record.slice_by) if record.slice_by else None
        found = preview(
            record.id, selector, record.stages, self._store.live_device_attributes(), dimension
        )
        return record, found

    def _refuse_empty(self, selector: Selector) -> None:
        devices = self._store.live_device_attributes()
        if any(selector.matches(attrs) for _, attrs in devices):
            return
        raise errors.FailedPrecondition(
            f"selector {str(selector)!r:.200} matches none of the {len(devices)} devices "
            "today (a typo?): check it with `skiff fleet ls --select`, or pass --allow-empty "
            "to create the rollout anyway (devices that match later get it)"
        )

    def _validated(
        self, spec: RolloutSpec, actor: str
    ) -> tuple[RolloutRecord, RolloutEventRecord, Selector]:
        """Check every part of `spec`; return the record and audit entry to store."""
        # Strict: a key that is neither standard nor custom.KEY is a typo, named.
        selector = parse_selector(spec.selector, strict=True)
        stages = parse_stages(spec.stages)
        if not 0 <= spec.bake_s <= MAX_BAKE_S:
            raise errors.InvalidArgument(f"bake must be between 0s and {MAX_BAKE_S}s")
        if not -MAX_PRIORITY <= spec.priority <= MAX_PRIORITY:
            raise errors.InvalidArgument(f"priority must be within ±{MAX_PRIORITY}")
        validate_name(spec.model)
        if not 1 <= spec.version <= MAX_VERSION:
            raise errors.InvalidArgument(f"version must be 1 to {MAX_VERSION}")
        if spec.variant and not VARIANT_NAME.fullmatch(spec.variant):
            raise errors.InvalidArgument(f"invalid variant {spec.variant!r:.40}")
        parsed = parse_rules(spec.halt_rules)  # position and reason
        rules = tuple(str(r) for r in parsed)
        compared = [r.metric for r in parsed if r.metric in BASELINE_METRICS]
        if compared and stages[0] >= 100:
            # Cohorts are by assignment: a first stage of every selected device leaves
            # no baseline (devices not in the stage), and such a rule would never judge.
            raise errors.InvalidArgument(
                f"{compared[0]} compares with devices the rollout has not reached yet, and "
                "a first stage of 100% leaves none: start with a smaller stage "
                "(e.g. --stages 10,100)"
            )
        slice_by = ""
        if spec.slice_by:
            # Stored as the dimension itself ("os_version:major"), so the rollout keeps its
            # slices whatever the device_class setting becomes later.
            slice_by = str(self._class.dimension(spec.slice_by))  # else names the known ones
            if not rules:
                raise errors.InvalidArgument("--slice-by needs at least one --halt rule")
        download_on, download_while = download_policy.check(spec.download_on, spec.download_while)
        if not 0 <= spec.min_devices <= MAX_MIN_DEVICES:
            raise errors.InvalidArgument(f"min devices must be between 0 and {MAX_MIN_DEVICES}")
        if not 0 <= spec.min_inferences <= MAX_MIN_INFERENCES:
            raise errors.InvalidArgument(
                f"min inferences must be between 0 and {MAX_MIN_INFERENCES}"
            )
        version = self._store.get_version(spec.model, spec.version)  # NotFound names it
        # fp32 is every tensor model's base; a language model has only the bundles it
        # was pushed with, its first one (q4 unless the push named others) the default.
        variant = spec.variant or default_variant([v.name for v in version.variants])
        found = version.variant(variant)
        if found is None:
            have = ", ".join(v.name for v in version.variants)
            raise errors.NotFound(
                f"{spec.model}:{spec.version} has no variant {variant!r} (it has {have})"
            )
        llm_rules = [r.metric for r in parsed if r.metric in LLM_METRICS]
        if llm_rules and "llm" not in version.signature:
            raise errors.InvalidArgument(
                f"{llm_rules[0]} judges a language model's tokens, and {spec.model}:"
                f"{spec.version} is not one (use the latency rules, e.g. p95_latency_ratio>1.2)"
            )
        evidence = {}
        if found.degraded:
            why = degraded_reason(found)
            if not spec.allow_degraded:
                raise errors.FailedPrecondition(
                    f"{spec.model}:{spec.version} variant {variant} is degraded ({why}): "
                    "pass --allow-degraded to roll it out anyway"
                )
            # The audit log keeps that the operator rolled it out knowing.
            evidence = {"allow_degraded": True, "variant": variant, "degraded": why}
        now = self._clock()
        record = RolloutRecord(
            id=ROLLOUT_PREFIX + secrets.token_hex(5),
            model=spec.model,
            version=spec.version,
            variant=variant,
            selector=str(selector),
            stages=stages,
            stage=0,
            state=RolloutState.ACTIVE.value,
            bake_s=spec.bake_s,
            priority=spec.priority,
            created_at=now,
            created_by=actor,
            stage_started_at=now,
            halt_rules=rules,
            min_devices=spec.min_devices or DEFAULT_MIN_DEVICES,
            min_inferences=spec.min_inferences or DEFAULT_MIN_INFERENCES,
            slice_by=slice_by,
            download_on=download_on,
            download_while=download_while,
        )
        event = RolloutEventRecord(
            now,
            actor,
            "create",
            "",
            RolloutState.ACTIVE.value,
            0,
            _check_reason(spec.reason),
            evidence=evidence,
        )
        return record, event, selector

    def download_bytes(self, record: RolloutRecord) -> tuple[int, dict[int, int]]:
        """Return the bytes a device fetches for the rollout's variant: (full, by version).

        By version: from each of up to DELTA_VERSIONS earlier versions of that variant
        (with chunks, only the chunks that version lacks).
        """
        key = (record.model, record.version, record.variant)
        if key not in self._downloads:
            target = self.variant_of(record)
            if target is None:
                return 0, {}
            earlier = self._store.list_versions(record.model)
            earlier = [v for v in earlier if v.number < record.version][-DELTA_VERSIONS:]
            full, wanted = _download_set(target)
            deltas = {}
            for v in earlier:
                held = v.variant(record.variant)
                if held is not None:
                    _, have = _download_set(held)
                    deltas[v.number] = sum(n for c, n in wanted.items() if c not in have)
            if len(self._downloads) >= _VARIANT_CACHE:
                self._downloads.clear()
            self._downloads[key] = (full, deltas)
        return self._downloads[key]

    def variant_of(self, record: RolloutRecord) -> VariantRecord | None:
        """Return the variant a rollout ships (None if its version is gone)."""
        key = (record.model, record.version, record.variant)
        if key not in self._variants:
            try:
                found = self._store.get_version(record.model, record.version)
            except errors.NotFound:
                return None
            if len(self._variants) >= _VARIANT_CACHE:
                self._variants.clear()
            self._variants[key] = found.variant(record.variant)
        return self._variants[key]

    def get(self, rollout_id: str) -> RolloutRecord:
        """Return one rollout with its audit log."""
        if not rollout_id.startswith(ROLLOUT_PREFIX) or len(rollout_id) > 32:
            raise errors.InvalidArgument(f"invalid rollout id {rollout_id!r:.40}: expected ro_...")
        return self._store.get_rollout(rollout_id)

    def list(self, model: str | None = None) -> list[RolloutRecord]:
        """Return rollouts, oldest first."""
        return self._store.list_rollouts(model=model or None)

    def transition(
        self,
        rollout_id: str,
        action: str,
        *,
        actor: str,
        reason: str = "",
        expected_stage: int | None = None,
        slice: str = "",
    ) -> RolloutRecord:
        """Pause, resume, promote or roll back; FailedPrecondition names the current state.

        With `expected_stage`, the change applies only if the rollout is still at that
        stage, so a retried or doubled promote cannot skip a stage. With `slice`
        (`soc=sm8450`), resume readmits one rolled-back slice and rollback rolls one back.
        """
        if slice:
            return self._slice_action(rollout_id, action, slice, actor=actor, reason=reason)
        try:
            act = Action(action)
        except ValueError:
            raise errors.InvalidArgument(
                f"unknown action {action!r:.40}: use pause, resume, promote or rollback"
            ) from None
        if act == Action.ADVANCE:
            raise errors.InvalidArgument("advance is the scheduler's; use promote")
        current = self.get(rollout_id)
        if expected_stage is not None and expected_stage != current.stage:
            raise errors.FailedPrecondition(
                f"rollout {rollout_id} is at {stage_text(current.stage, current.stages)}, not "
                f"stage {expected_stage + 1}: it moved on (look again and retry)"
            )
        try:
            changed = self._apply(current, act, actor=actor, reason=_check_reason(reason))
        except errors.FailedPrecondition as exc:  # name the rollout the refusal is about
            raise errors.FailedPrecondition(f"rollout {rollout_id}: {exc}") from None
        if changed is None:
            raise errors.FailedPrecondition(
                f"rollout {rollout_id} changed while this {action} ran; look again and retry"
            )
        return changed

    def _slice_action(
        self, rollout_id: str, action: str, slice: str, *, actor: str, reason: str
    ) -> RolloutRecord:
        states = {"resume": "active", "rollback": "rolled_back"}
        if action not in states:
            raise errors.InvalidArgument(f"--slice works with resume and rollback, not {action}")
        current = self.get(rollout_id)
        name, eq, value = slice.partition("=")
        if not eq or not name:
            raise errors.InvalidArgument(f"invalid slice {slice!r:.80}: use ATTRIBUTE=VALUE")
        check_text("slice value", value, MAX_ATTRIBUTE)
        if not current.slice_by:
            raise errors.FailedPrecondition(f"rollout {rollout_id} is not sliced (no --slice-by)")
        dim = parse_dimension(current.slice_by)
        if name != dim.name:
            raise errors.InvalidArgument(
                f"rollout {rollout_id} is sliced by {dim.name}, not {name!r:.70}"
            )
        value = dim.normalize(value)  # os_version=14.1 names slice 14 when sliced by major
        if current.state in (RolloutState.ROLLED_BACK, RolloutState.COMPLETED) and (
            action == "resume"
        ):
            raise errors.FailedPrecondition(
                f"cannot readmit a slice of a rollout that is {current.state} (guardrails no "
                f"longer watch it): roll it out to that slice with a new rollout "
                f"(--select {slice})"
            )
        if current.state == RolloutState.PAUSED and action == "resume":
            # Paused is frozen: readmitting would give its devices the version meanwhile.
            raise errors.FailedPrecondition(
                f"cannot readmit a slice of a rollout that is paused: resume the rollout "
                f"first (skiff rollout resume {rollout_id}), then the slice"
            )
        changed = self.set_slice(
            rollout_id, value, states[action], actor=actor, reason=_check_reason(reason)
        )
        if changed is None:
            raise errors.FailedPrecondition(f"slice {slice} is already {states[action]}")
        return changed

    def set_slice(
        self,
        rollout_id: str,
        value: str,
        state: str,
        *,
        actor: str,
        reason: str,
        evidence: dict | None = None,
        expected: dict | None = None,
    ) -> RolloutRecord | None:
        """Roll one slice back or readmit it; None when it already was.

        With `expected` (the guard's call: the slice's state when it looked), also None
        when the slice changed since, or the rollout is no longer active.
        """
        current = self.get(rollout_id)
        if expected is not None and current.state != RolloutState.ACTIVE:
            return None
        now = self._clock()
        action = "slice_rollback" if state == "rolled_back" else "slice_resume"
        event = RolloutEventRecord(
            now,
            actor,
            action,
            current.state,
            current.state,
            current.stage,
            reason,
            slice=f"{parse_dimension(current.slice_by).name}={value}",
            evidence=evidence or {},
        )
        changed = self._store.set_slice(
            rollout_id, value, {"state": state, "since": now.isoformat()}, event, expected=expected
        )
        if changed is not None:
            log.info(
                "rollout %s: slice %s=%s %s (%s)", rollout_id, current.slice_by, value, state, actor
            )
        return changed

    def halt(self, record: RolloutRecord, *, reason: str, evidence: dict) -> RolloutRecord | None:
        """Pause a rollout for a guardrail, with its evidence; None if it moved on."""
        return self._apply(
            record, Action.PAUSE, actor=GUARDRAIL, reason=reason[:MAX_REASON], evidence=evidence
        )

    def list_active_with_rules(self) -> list[RolloutRecord]:
        """Return the active rollouts that carry halt rules."""
        return [
            r
            for r in self._store.list_rollouts(states=(RolloutState.ACTIVE.value,))
            if r.halt_rules
        ]

    def advance_due(
        self, ready: Callable[[RolloutRecord], bool] | None = None
    ) -> list[RolloutRecord]:
        """Advance every active rollout whose current stage has baked (the scheduler).

        A rollout without a bake time advances only when an operator promotes it; one
        with halt rules only when `ready` says every rule passed with enough sample.
        """
        now, advanced = self._clock(), []
        for r in self._store.list_rollouts(states=(RolloutState.ACTIVE.value,)):
            if r.bake_s == 0 or r.stage_started_at + dt.timedelta(seconds=r.bake_s) > now:
                continue
            if ready is not None and r.halt_rules and not ready(r):
                continue
            # Timed from the stage start it read: a pause and resume since restarted it.
            done = self._apply(
                r, Action.ADVANCE, actor="scheduler", reason="bake time passed", timed=True
            )
            if done is not None:  # None: another replica or an operator got there first
                advanced.append(done)
        return advanced

    def _apply(
        self,
        r: RolloutRecord,
        act: Action,
        *,
        actor: str,
        reason: str,
        evidence: dict | None = None,
        timed: bool = False,
    ) -> RolloutRecord | None:
        state, stage = next_step(RolloutState(r.state), act, r.stage, len(r.stages))
        now = self._clock()
        started = now if stage != r.stage or act == Action.RESUME else r.stage_started_at
        event = RolloutEventRecord(
            now, actor, act.value, r.state, state.value, stage, reason, evidence=evidence or {}
        )
        change = RolloutChange(
            r.id,
            r.state,
            r.stage,
            state.value,
            stage,
            started,
            event,
            expected_started_at=r.stage_started_at if timed else None,
        )
        result = self._store.change_rollout(change)
        if result is not None:
            where = stage_text(stage, r.stages)
            log.info("rollout %s: %s -> %s, %s (%s)", r.id, r.state, state, where, actor)
        return result

    def counts(self, record: RolloutRecord) -> Counts:
        """Count selected, in-stage, synced, installed and failed live devices for one rollout."""
        snapshot = self._resolver.snapshot()
        selector = parse_selector(record.selector)
        live = snapshot.by_id.get(record.id)
        selected = in_stage = 0
        reasons: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for device_id, attrs in self._store.live_device_attributes():
            if not selector.matches(attrs):
                continue
            selected += 1
            if live is not None and (unfit := live.misfit(attrs)) is not None:
                reasons[unfit[0]] = reasons.get(unfit[0], 0) + 1
                continue
            if live is not None and live.includes(device_id) and (wait := live.waits(attrs)):
                waiting[wait[0]] = waiting.get(wait[0], 0) + 1
                continue
            desired = snapshot.desired_model(record.model, device_id, attrs)
            in_stage += desired is not None and desired.rollout == record.id
        synced, installed, failed = self._store.count_model_states(
            record.model, record.version, record.variant
        )
        return Counts(
            selected,
            in_stage,
            synced,
            installed,
            failed,
            sum(reasons.values()),
            reasons,
            sum(waiting.values()),
            waiting,
        )


def _download_set(variant: VariantRecord) -> tuple[int, dict[str, int]]:
    """Return a variant's full download size and what it is made of ({blob: bytes})."""
    if not variant.chunks:
        return variant.ciphertext_size, {variant.ciphertext_sha256: variant.ciphertext_size}
    parts = chunk_sizes(variant.chunks)
    return sum(parts.values()), parts
