"""The rollout store interface: rollouts and their audit log."""

from __future__ import annotations

import abc
import datetime as dt
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RolloutEventRecord:
    """One entry of a rollout's audit log."""

    at: dt.datetime
    actor: str
    action: str
    from_state: str
    to_state: str
    stage: int
    reason: str
    slice: str = ""  # "soc=sm8450" when a guardrail or operator acted on one slice
    evidence: dict = field(default_factory=dict)


@dataclass(frozen=True)
class RolloutRecord:
    """A rollout as stored."""

    id: str
    model: str
    version: int
    variant: str
    selector: str
    stages: tuple[float, ...]
    stage: int
    state: str
    bake_s: int
    priority: int
    created_at: dt.datetime
    created_by: str
    stage_started_at: dt.datetime
    audit: tuple[RolloutEventRecord, ...] = ()
    halt_rules: tuple[str, ...] = ()
    min_devices: int = 0
    min_inferences: int = 0
    slice_by: str = ""
    # Slice value -> {"state": "rolled_back" | "active", "since": ISO time}; absent: active.
    slices: dict = field(default_factory=dict)
    # When devices may fetch it (control_plane.rollouts.download_policy).
    download_on: str = "any"
    download_while: str = "any"

    def rolled_back_slices(self) -> frozenset[str]:
        """Return the slice values this rollout no longer applies to."""
        return frozenset(v for v, s in self.slices.items() if s.get("state") == "rolled_back")


@dataclass(frozen=True)
class RolloutChange:
    """A conditional update: applies only if the rollout is still in `expected`."""

    rollout_id: str
    expected_state: str
    expected_stage: int
    state: str
    stage: int
    stage_started_at: dt.datetime
    event: RolloutEventRecord
    # Also only if the stage still started then: the scheduler's bake was timed from it,
    # and a pause and resume in between restarted it (None: any start).
    expected_started_at: dt.datetime | None = None


class RolloutStore(abc.ABC):
    """Persistent state of rollouts."""

    @abc.abstractmethod
    def create_rollout(self, record: RolloutRecord, event: RolloutEventRecord) -> RolloutRecord:
        """Insert a rollout with its first audit entry and bump the fleet revision."""

    @abc.abstractmethod
    def get_rollout(self, rollout_id: str) -> RolloutRecord:
        """Return one rollout with its audit log; NotFound otherwise."""

    @abc.abstractmethod
    def list_rollouts(
        self, *, model: str | None = None, states: tuple[str, ...] | None = None
    ) -> list[RolloutRecord]:
        """Return rollouts (without audit logs), oldest first, optionally filtered."""

    @abc.abstractmethod
    def set_slice(
        self,
        rollout_id: str,
        value: str,
        state: dict,
        event: RolloutEventRecord,
        *,
        expected: dict | None = None,
    ) -> RolloutRecord | None:
        """Set one slice's state, with its audit entry, and bump the revision.

        None (nothing done) when the slice is already in that state, or, with `expected`,
        when it is no longer in that state (someone changed it meanwhile; {} = never
        changed), or when the rollout is no longer in the state the event says it is.
        """

    @abc.abstractmethod
    def change_rollout(self, change: RolloutChange) -> RolloutRecord | None:
        """Apply `change` and bump the revision; None (nothing done) if the rollout moved on."""
