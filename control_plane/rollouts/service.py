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
from dataclasses import dataclass

from control_plane import errors
from control_plane.fleet.selector import parse_selector
from control_plane.limits import MAX_REASON, check_text
from control_plane.registry.requests import MAX_VERSION, VARIANT_NAME, validate_name
from control_plane.rollouts.lifecycle import (
    MAX_BAKE_S,
    MAX_PRIORITY,
    Action,
    RolloutState,
    next_step,
    parse_stages,
)
from control_plane.rollouts.resolver import Resolver
from control_plane.store.base import RegistryStore
from control_plane.store.fleet import FleetStore
from control_plane.store.rollouts import (
    RolloutChange,
    RolloutEventRecord,
    RolloutRecord,
    RolloutStore,
)

log = logging.getLogger(__name__)

ROLLOUT_PREFIX = "ro_"
BASE_VARIANT = "fp32"


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


@dataclass(frozen=True)
class Counts:
    """How far a rollout has got through the fleet."""

    selected: int
    in_stage: int
    synced: int
    installed: int
    failed: int = 0  # devices whose telemetry says this version failed or was rolled back


def utcnow() -> dt.datetime:
    """Return the current time, aware UTC."""
    return dt.datetime.now(dt.UTC)


def _check_reason(reason: str) -> str:
    return check_text("reason", reason, MAX_REASON)


class Rollouts:
    """The rollout domain over the store; transport-free."""

    def __init__(
        self,
        store: RolloutStore | FleetStore | RegistryStore,
        resolver: Resolver,
        *,
        clock: Callable[[], dt.datetime] = utcnow,
    ) -> None:
        self._store, self._resolver, self._clock = store, resolver, clock

    def create(self, spec: RolloutSpec, *, actor: str) -> RolloutRecord:
        """Validate and store a new active rollout at its first stage."""
        selector = parse_selector(spec.selector)  # position and reason on a bad one
        stages = parse_stages(spec.stages)
        if not 0 <= spec.bake_s <= MAX_BAKE_S:
            raise errors.InvalidArgument(f"bake must be between 0s and {MAX_BAKE_S}s")
        if not -MAX_PRIORITY <= spec.priority <= MAX_PRIORITY:
            raise errors.InvalidArgument(f"priority must be within ±{MAX_PRIORITY}")
        variant = spec.variant or BASE_VARIANT
        validate_name(spec.model)
        if not 1 <= spec.version <= MAX_VERSION:
            raise errors.InvalidArgument(f"version must be 1 to {MAX_VERSION}")
        if not VARIANT_NAME.fullmatch(variant):
            raise errors.InvalidArgument(f"invalid variant {variant!r:.40}")
        version = self._store.get_version(spec.model, spec.version)  # NotFound names it
        if version.variant(variant) is None:
            have = ", ".join(v.name for v in version.variants)
            raise errors.NotFound(
                f"{spec.model}:{spec.version} has no variant {variant!r} (it has {have})"
            )
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
        )
        event = RolloutEventRecord(
            now, actor, "create", "", RolloutState.ACTIVE.value, 0, _check_reason(spec.reason)
        )
        created = self._store.create_rollout(record, event)
        log.info(
            "rollout %s created: %s:%d to %r", created.id, spec.model, spec.version, str(selector)
        )
        return created

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
    ) -> RolloutRecord:
        """Pause, resume, promote or roll back; FailedPrecondition names the current state.

        With `expected_stage`, the change applies only if the rollout is still at that
        stage, so a retried or doubled promote cannot skip a stage.
        """
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
                f"rollout {rollout_id} is at stage {current.stage + 1}, not "
                f"{expected_stage + 1}: it moved on (look again and retry)"
            )
        changed = self._apply(current, act, actor=actor, reason=_check_reason(reason))
        if changed is None:
            raise errors.FailedPrecondition(
                f"rollout {rollout_id} changed while this {action} ran; look again and retry"
            )
        return changed

    def advance_due(self) -> list[RolloutRecord]:
        """Advance every active rollout whose current stage has baked (the scheduler).

        A rollout without a bake time advances only when an operator promotes it.
        """
        now, advanced = self._clock(), []
        for r in self._store.list_rollouts(states=(RolloutState.ACTIVE.value,)):
            if r.bake_s == 0 or r.stage_started_at + dt.timedelta(seconds=r.bake_s) > now:
                continue
            done = self._apply(r, Action.ADVANCE, actor="scheduler", reason="bake time passed")
            if done is not None:  # None: another replica or an operator got there first
                advanced.append(done)
        return advanced

    def _apply(
        self, r: RolloutRecord, act: Action, *, actor: str, reason: str
    ) -> RolloutRecord | None:
        state, stage = next_step(RolloutState(r.state), act, r.stage, len(r.stages))
        now = self._clock()
        started = now if stage != r.stage or act == Action.RESUME else r.stage_started_at
        event = RolloutEventRecord(now, actor, act.value, r.state, state.value, stage, reason)
        change = RolloutChange(r.id, r.state, r.stage, state.value, stage, started, event)
        result = self._store.change_rollout(change)
        if result is not None:
            log.info("rollout %s: %s -> %s, stage %d (%s)", r.id, r.state, state, stage, actor)
        return result

    def counts(self, record: RolloutRecord) -> Counts:
        """Count selected, in-stage, synced, installed and failed live devices for one rollout."""
        snapshot = self._resolver.snapshot()
        selector = parse_selector(record.selector)
        selected = in_stage = 0
        for device_id, attrs in self._store.live_device_attributes():
            if not selector.matches(attrs):
                continue
            selected += 1
            desired = snapshot.desired_model(record.model, device_id, attrs)
            in_stage += desired is not None and desired.rollout == record.id
        synced, installed, failed = self._store.count_model_states(
            record.model, record.version, record.variant
        )
        return Counts(selected, in_stage, synced, installed, failed)
