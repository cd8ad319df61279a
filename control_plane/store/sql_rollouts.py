"""SQL implementation of the rollout store, mixed into `SqlStore` (one engine, one scope)."""

from __future__ import annotations

from sqlalchemy import select, update
from sqlalchemy.orm import selectinload

from contract import errors
from control_plane.store import orm
from control_plane.store.rollouts import (
    RolloutChange,
    RolloutEventRecord,
    RolloutRecord,
    RolloutStore,
)
from control_plane.store.sql_fleet import aware, bump_revision


def _event(row: orm.RolloutEventRow) -> RolloutEventRecord:
    return RolloutEventRecord(
        at=aware(row.at),
        actor=row.actor,
        action=row.action,
        from_state=row.from_state,
        to_state=row.to_state,
        stage=row.stage,
        reason=row.reason,
        slice=row.slice or "",
        evidence=dict(row.evidence or {}),
    )


def _rollout(row: orm.RolloutRow, *, audit: bool) -> RolloutRecord:
    return RolloutRecord(
        id=row.id,
        model=row.model,
        version=row.version,
        variant=row.variant,
        selector=row.selector,
        stages=tuple(float(s) for s in row.stages),
        stage=row.stage,
        state=row.state,
        bake_s=row.bake_s,
        priority=row.priority,
        created_at=aware(row.created_at),
        created_by=row.created_by,
        stage_started_at=aware(row.stage_started_at),
        audit=tuple(_event(e) for e in row.events) if audit else (),
        halt_rules=tuple(row.halt_rules or ()),
        min_devices=row.min_devices or 0,
        min_inferences=row.min_inferences or 0,
        slice_by=row.slice_by or "",
        slices=dict(row.slices or {}),
        download_on=row.download_on or "any",
        download_while=row.download_while or "any",
    )


def _event_row(rollout_id: str, e: RolloutEventRecord) -> orm.RolloutEventRow:
    return orm.RolloutEventRow(rollout_id=rollout_id, **e.__dict__)


class SqlRolloutStore(RolloutStore):
    """The rollout half of `SqlStore`; needs `_scope()` and `_read()` from it."""

    def create_rollout(self, record: RolloutRecord, event: RolloutEventRecord) -> RolloutRecord:
        """Insert a rollout with its first audit entry and bump the fleet revision."""
        with self._scope() as session:
            row = orm.RolloutRow(
                id=record.id,
                model=record.model,
                version=record.version,
                variant=record.variant,
                selector=record.selector,
                stages=list(record.stages),
                stage=record.stage,
                state=record.state,
                bake_s=record.bake_s,
                priority=record.priority,
                created_at=record.created_at,
                created_by=record.created_by,
                stage_started_at=record.stage_started_at,
                halt_rules=list(record.halt_rules),
                min_devices=record.min_devices,
                min_inferences=record.min_inferences,
                slice_by=record.slice_by,
                slices=dict(record.slices),
                download_on=record.download_on,
                download_while=record.download_while,
                events=[_event_row(record.id, event)],
            )
            session.add(row)
            bump_revision(session, "rollout", record.id)
            session.flush()
            return _rollout(row, audit=True)

    def get_rollout(self, rollout_id: str) -> RolloutRecord:
        """Return one rollout with its audit log."""
        with self._read() as session:
            row = session.scalar(
                select(orm.RolloutRow)
                .where(orm.RolloutRow.id == rollout_id)
                .options(selectinload(orm.RolloutRow.events))
            )
            if row is None:
                raise errors.NotFound(f"rollout {rollout_id!r} not found")
            return _rollout(row, audit=True)

    def list_rollouts(
        self, *, model: str | None = None, states: tuple[str, ...] | None = None
    ) -> list[RolloutRecord]:
        """Return rollouts without audit logs, oldest first."""
        stmt = select(orm.RolloutRow).order_by(orm.RolloutRow.created_at, orm.RolloutRow.id)
        if model is not None:
            stmt = stmt.where(orm.RolloutRow.model == model)
        if states is not None:
            stmt = stmt.where(orm.RolloutRow.state.in_(states))
        with self._read() as session:
            return [_rollout(r, audit=False) for r in session.scalars(stmt)]

    def set_slice(
        self,
        rollout_id: str,
        value: str,
        state: dict,
        event: RolloutEventRecord,
        *,
        expected: dict | None = None,
    ) -> RolloutRecord | None:
        """Set one slice's state under a row lock, with its audit entry."""
        with self._scope() as session:
            row = session.get(orm.RolloutRow, rollout_id, with_for_update=True)
            if row is None:
                raise errors.NotFound(f"rollout {rollout_id!r} not found")
            slices = dict(row.slices or {})
            if slices.get(value, {}).get("state", "active") == state["state"]:
                return None
            if expected is not None and slices.get(value, {}) != expected:
                return None  # changed since the caller looked (an operator's readmission)
            if row.state != event.from_state:
                return None  # paused, rolled back or completed since the caller looked
            slices[value] = state
            row.slices = slices
            session.add(_event_row(rollout_id, event))
            bump_revision(session, "rollout", rollout_id)
        return self.get_rollout(rollout_id)

    def change_rollout(self, change: RolloutChange) -> RolloutRecord | None:
        """Apply a conditional state/stage change with its audit entry."""
        expected = [
            orm.RolloutRow.id == change.rollout_id,
            orm.RolloutRow.state == change.expected_state,
            orm.RolloutRow.stage == change.expected_stage,
        ]
        if change.expected_started_at is not None:
            expected.append(orm.RolloutRow.stage_started_at == change.expected_started_at)
        with self._scope() as session:
            done = session.execute(
                update(orm.RolloutRow)
                .where(*expected)
                .values(
                    state=change.state,
                    stage=change.stage,
                    stage_started_at=change.stage_started_at,
                )
            )
            if done.rowcount != 1:
                return None
            session.add(_event_row(change.rollout_id, change.event))
            bump_revision(session, "rollout", change.rollout_id)
        return self.get_rollout(change.rollout_id)
