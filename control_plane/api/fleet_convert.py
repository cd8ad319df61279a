"""Conversions between fleet/rollout messages and domain records."""

from __future__ import annotations

import json

from contract.attribute_messages import (  # noqa: F401 - re-exported for the API layer
    attributes_dict,
    attributes_pb,
    timestamp,
)
from control_plane.fleet.attributes import attested_attributes
from control_plane.rollouts.guard import Health, SliceHealth
from control_plane.rollouts.lifecycle import stage_number
from control_plane.rollouts.preview import Preview
from control_plane.rollouts.resolver import Desired
from control_plane.rollouts.service import Counts, degraded_reason
from control_plane.rollouts.verdict_text import verdict_sentence
from control_plane.store.base import VariantRecord
from control_plane.store.fleet import DeviceRecord, ModelState
from control_plane.store.rollouts import RolloutRecord
from control_plane.telemetry.recommend import ClassBackends
from protos import device_pb2, fleet_pb2


def states(msgs) -> tuple[ModelState, ...]:
    """Return model states from InstalledModel messages."""
    return tuple(ModelState(m.model, m.version, m.variant) for m in msgs)


def states_pb(items: tuple[ModelState, ...]) -> list[device_pb2.InstalledModel]:
    """Return InstalledModel messages for model states."""
    return [
        device_pb2.InstalledModel(model=s.model, version=s.version, variant=s.variant)
        for s in items
    ]


INT64_MAX = 2**63 - 1


def device_pb(d: DeviceRecord, *, online: bool, desired: dict[str, Desired]) -> fleet_pb2.Device:
    """Return the message for a device with its derived desired state."""
    msg = fleet_pb2.Device(
        id=d.id,
        attributes=attributes_pb(d.attributes),
        attested=attributes_pb(attested_attributes(d.attributes)),
        enrolled_at=timestamp(d.enrolled_at),
        last_seen=timestamp(d.last_seen),
        online=online,
        revoked=d.revoked_at is not None,
        installed=states_pb(d.installed),
        synced=states_pb(d.synced),
        desired={
            m: fleet_pb2.DesiredModel(version=x.version, variant=x.variant, rollout=x.rollout)
            for m, x in desired.items()
        },
        reports_refused=min(d.reports_refused, INT64_MAX),
        last_refusal=d.last_refusal,
    )
    if d.last_refusal_at is not None:
        msg.last_refusal_at.CopyFrom(timestamp(d.last_refusal_at))
    if d.clock_offset_s is not None:
        msg.clock_offset_s = d.clock_offset_s
    return msg


def rollout_pb(
    r: RolloutRecord,
    counts: Counts | None = None,
    health: Health | None = None,
    *,
    variant: VariantRecord | None = None,
) -> fleet_pb2.Rollout:
    """Return the message for a rollout (with its audit log, counts and health if given).

    Stages are numbered from 1 in the message (the record keeps the index). `variant`,
    the one it ships, marks a degraded one.
    """
    msg = fleet_pb2.Rollout(
        id=r.id,
        model=r.model,
        version=r.version,
        variant=r.variant,
        selector=r.selector,
        stages=list(r.stages),
        stage=stage_number(r.stage),
        state=r.state,
        bake_s=r.bake_s,
        priority=r.priority,
        created_at=timestamp(r.created_at),
        created_by=r.created_by,
        stage_started_at=timestamp(r.stage_started_at),
        audit=[
            fleet_pb2.RolloutEvent(
                at=timestamp(e.at),
                actor=e.actor,
                action=e.action,
                from_state=e.from_state,
                to_state=e.to_state,
                stage=stage_number(e.stage),
                reason=e.reason,
                slice=e.slice,
                evidence_json=json.dumps(e.evidence, sort_keys=True) if e.evidence else "",
            )
            for e in r.audit
        ],
        halt_rules=list(r.halt_rules),
        min_devices=r.min_devices,
        min_inferences=r.min_inferences,
        slice_by=r.slice_by,
        download_on=r.download_on,
        download_while=r.download_while,
    )
    if variant is not None and variant.degraded:
        msg.degraded, msg.degraded_reason = True, degraded_reason(variant)
        msg.degraded_allowed = any(e.evidence.get("allow_degraded") for e in r.audit if e.evidence)
    if counts is not None:
        msg.counts.CopyFrom(fleet_pb2.RolloutCounts(**counts.__dict__))
    if health is not None:
        msg.health.CopyFrom(
            fleet_pb2.RolloutHealth(
                since=timestamp(health.since),
                overall=_slice_pb(health.overall),
                slices=[_slice_pb(s) for s in health.slices],
                outside_reports=min(health.outside_reports, INT64_MAX),
                outside_devices=health.outside_devices,
            )
        )
    return msg


def preview_pb(p: Preview) -> fleet_pb2.RolloutPreview:
    """Return what a rollout would select as its message."""
    return fleet_pb2.RolloutPreview(
        selected=p.selected,
        devices=list(p.devices),
        slices=[fleet_pb2.SlicePreview(slice=s.slice, devices=list(s.devices)) for s in p.slices],
        more_slices=p.more_slices,
    )


def _cohort_pb(figures: dict) -> fleet_pb2.CohortFigures:
    return fleet_pb2.CohortFigures(
        **{
            k: min(v, INT64_MAX) if isinstance(v, int) else v
            for k, v in figures.items()
            if v is not None
        }
    )


def _slice_pb(s: SliceHealth) -> fleet_pb2.SliceHealth:
    return fleet_pb2.SliceHealth(
        slice=s.name,
        state=s.state,
        since=timestamp(s.since),
        candidate=_cohort_pb(s.candidate.figures()),
        baseline=_cohort_pb(s.baseline.figures()),
        rules=[
            fleet_pb2.RuleVerdict(
                **{k: v for k, v in v.to_dict().items() if k != "sample" and v is not None},
                sentence=verdict_sentence(v),
            )
            for v in s.verdicts
        ],
    )


def backends_pb(t: ClassBackends) -> fleet_pb2.ClassBackends:
    """Return one device class's backend table as its message."""
    return fleet_pb2.ClassBackends(
        variant=t.variant,
        device_class=t.device_class,
        recommended=t.recommended or "",
        configs=[
            fleet_pb2.BackendFigures(
                **{
                    k: min(v, INT64_MAX) if isinstance(v, int) and not isinstance(v, bool) else v
                    for k, v in c.to_dict().items()
                    if v is not None
                }
            )
            for c in t.configs
        ],
    )
