"""FleetService and RolloutService: what operators call (API tokens). Thin adapters."""

from __future__ import annotations

import datetime as dt
import hashlib

from control_plane import errors, paging
from control_plane.api.access import caller
from control_plane.api.fleet_convert import (
    attributes_dict,
    backends_pb,
    device_pb,
    rollout_pb,
    timestamp,
)
from control_plane.api.grpc_errors import mapped
from control_plane.api.telemetry_convert import install_pb, latency_pb
from control_plane.fleet.devices import Fleet, validate_device_id
from control_plane.fleet.writer import DeviceWriter
from control_plane.registry.requests import MAX_VERSION, VARIANT_NAME, validate_name
from control_plane.rollouts.guard import Guard
from control_plane.rollouts.resolver import Resolver, Snapshot
from control_plane.rollouts.service import Rollouts, RolloutSpec
from control_plane.rollouts.watchers import Watchers
from control_plane.store.base import RegistryStore
from control_plane.store.fleet import DeviceRecord
from control_plane.telemetry import Telemetry
from control_plane.telemetry.recommend import Recommendations
from protos import fleet_pb2, fleet_pb2_grpc


def _actor() -> str:
    """Return the name of the caller's token (authenticated by the interceptor)."""
    return caller().name


class FleetView:
    """Devices as operators see them: stored state plus derived desired state and online."""

    def __init__(
        self,
        fleet: Fleet,
        resolver: Resolver,
        watchers: Watchers,
        writer: DeviceWriter,
        telemetry: Telemetry,
    ) -> None:
        self.fleet = fleet
        self._resolver, self._watchers, self._writer = resolver, watchers, writer
        self._telemetry = telemetry

    def device_pb(self, d: DeviceRecord, snap: Snapshot | None = None) -> fleet_pb2.Device:
        """Return one device's message (pass `snap` when rendering many)."""
        snap = snap or self._resolver.snapshot()
        now = dt.datetime.now(dt.UTC)
        online = d.revoked_at is None and (
            self._watchers.is_online(d.id) or (d.online_until is not None and d.online_until > now)
        )
        desired = {} if d.revoked_at else snap.desired(d.id, d.attributes)
        return device_pb(d, online=online, desired=desired)

    def device_detail_pb(self, d: DeviceRecord) -> fleet_pb2.Device:
        """Return one device's message with its recent installs and latency per model."""
        msg = self.device_pb(d)
        msg.recent_installs.extend(install_pb(i) for i in self._telemetry.recent_installs(d.id))
        msg.latency.extend(latency_pb(x) for x in self._telemetry.latency(d.id))
        return msg

    def snapshot(self) -> Snapshot:
        """Return the current desired-state snapshot."""
        return self._resolver.snapshot()

    def flush(self) -> None:
        """Write the device reports this replica still holds back."""
        self._writer.flush()

    def list(
        self, selector: str, *, after: str = "", limit: int | None = None
    ) -> list[DeviceRecord]:
        """Return devices by id (after writing what this replica still holds back)."""
        self._writer.flush()
        return self.fleet.list(selector, after=after, limit=limit)

    def get(self, device_id: str) -> DeviceRecord:
        """Return one device (after writing what this replica still holds back)."""
        self._writer.flush()
        return self.fleet.get(device_id)


class FleetServicer(fleet_pb2_grpc.FleetServiceServicer):
    """Enrollment tokens and devices."""

    def __init__(
        self,
        view: FleetView,
        recommendations: Recommendations | None = None,
        versions: RegistryStore | None = None,
    ) -> None:
        self._view = view
        self._recommendations, self._registry = recommendations, versions

    @mapped
    def CreateEnrollmentToken(self, request, context):  # noqa: D102, N802
        actor = _actor()
        made = self._view.fleet.create_enrollment_token(
            actor=actor,
            ttl_s=request.ttl_s,
            uses=request.uses,
            attributes=attributes_dict(request.attributes),
            name=request.name,
        )
        return fleet_pb2.CreateEnrollmentTokenResponse(
            token=made.token,
            id=made.record.id,
            expires_at=timestamp(made.record.expires_at),
            uses=made.record.uses_left or 0,
        )

    @mapped
    def ListDevices(self, request, context):  # noqa: D102, N802
        _actor()
        # A token continues the listing of one selector only (hashed: selectors are long).
        scope = "devices:" + hashlib.sha256(request.selector.encode()).hexdigest()[:16]
        page = paging.page_request(
            request.page_size, request.page_token, scope=scope, parse_key=validate_device_id
        )
        records = self._view.list(request.selector, after=page.after or "", limit=page.size + 1)
        snap = self._view.snapshot()
        devices, token = paging.next_page(
            [self._view.device_pb(d, snap) for d in records],
            page,
            key=lambda d: d.id,
            byte_size=lambda d: d.ByteSize(),
        )
        return fleet_pb2.ListDevicesResponse(devices=devices, next_page_token=token)

    @mapped
    def GetDevice(self, request, context):  # noqa: D102, N802
        _actor()
        return self._view.device_detail_pb(self._view.get(request.id))

    @mapped
    def RevokeDevice(self, request, context):  # noqa: D102, N802
        _actor()
        self._view.fleet.revoke(request.id, reason=request.reason)
        return self._view.device_pb(self._view.get(request.id))

    @mapped
    def GetBackends(self, request, context):  # noqa: D102, N802
        _actor()
        validate_name(request.model)
        if not 1 <= request.version <= MAX_VERSION:
            raise errors.InvalidArgument(f"version must be 1 to {MAX_VERSION}")
        if request.variant and not VARIANT_NAME.fullmatch(request.variant):
            raise errors.InvalidArgument(f"invalid variant {request.variant!r:.40}")
        self._registry.get_version(request.model, request.version)  # NotFound names it
        tables = self._recommendations.table(
            request.model, request.version, request.variant or None
        )
        return fleet_pb2.GetBackendsResponse(classes=[backends_pb(t) for t in tables])


class RolloutOps:
    """Rollout reads and actions as messages: what RolloutService and the dashboard both call.

    One path for every operator action, whatever it came through, so the CLI and the
    dashboard apply the same checks and write the same audit log.
    """

    def __init__(self, rollouts: Rollouts, view: FleetView, guard: Guard) -> None:
        self._rollouts, self._view, self._guard = rollouts, view, guard

    def with_counts(self, record) -> fleet_pb2.Rollout:
        """Return a rollout's message with its device counts and guardrail health."""
        self._view.flush()  # counts include what devices reported to this replica
        return rollout_pb(record, self._rollouts.counts(record), self._guard.health(record))

    def get(self, rollout_id: str) -> fleet_pb2.Rollout:
        """Return one rollout with its counts and health."""
        return self.with_counts(self._rollouts.get(rollout_id))

    def list(self, model: str = "") -> list[fleet_pb2.Rollout]:
        """Return every rollout (of `model`, if given), without counts."""
        return [rollout_pb(r) for r in self._rollouts.list(model)]

    def create(self, spec: RolloutSpec, *, actor: str) -> fleet_pb2.Rollout:
        """Create a rollout."""
        return rollout_pb(self._rollouts.create(spec, actor=actor))

    def transition(
        self,
        rollout_id: str,
        action: str,
        *,
        actor: str,
        reason: str = "",
        expected_stage: int | None = None,
        slice: str = "",
    ) -> fleet_pb2.Rollout:
        """Pause, resume, promote or roll back (a slice of) a rollout, as `actor`."""
        record = self._rollouts.transition(
            rollout_id,
            action,
            actor=actor,
            reason=reason,
            expected_stage=expected_stage,
            slice=slice,
        )
        return self.with_counts(record)


class RolloutServicer(fleet_pb2_grpc.RolloutServiceServicer):
    """Rollouts."""

    def __init__(self, ops: RolloutOps) -> None:
        self._ops = ops

    @mapped
    def CreateRollout(self, request, context):  # noqa: D102, N802
        actor = _actor()
        spec = RolloutSpec(
            model=request.model,
            version=request.version,
            variant=request.variant,
            selector=request.selector,
            stages=tuple(request.stages),
            bake_s=request.bake_s,
            priority=request.priority,
            reason=request.reason,
            halt_rules=tuple(request.halt),
            min_devices=request.min_devices,
            min_inferences=request.min_inferences,
            slice_by=request.slice_by,
        )
        return self._ops.create(spec, actor=actor)

    @mapped
    def ListRollouts(self, request, context):  # noqa: D102, N802
        _actor()
        return fleet_pb2.ListRolloutsResponse(rollouts=self._ops.list(request.model))

    @mapped
    def GetRollout(self, request, context):  # noqa: D102, N802
        _actor()
        return self._ops.get(request.id)

    @mapped
    def TransitionRollout(self, request, context):  # noqa: D102, N802
        actor = _actor()
        expected = request.expected_stage if request.HasField("expected_stage") else None
        return self._ops.transition(
            request.id,
            request.action,
            actor=actor,
            reason=request.reason,
            expected_stage=expected,
            slice=request.slice,
        )
