"""The rollout store interface: rollouts and their audit log."""

from __future__ import annotations

import abc
import datetime as dt
from dataclasses import dataclass


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
    def change_rollout(self, change: RolloutChange) -> RolloutRecord | None:
        """Apply `change` and bump the revision; None (nothing done) if the rollout moved on."""
