"""FleetService and RolloutService: what operators call (API tokens). Thin adapters."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import re

from contract import errors
from contract.attribute_messages import attributes_dict as wire_attributes
from control_plane import paging
from control_plane.api.access import caller
from control_plane.api.fleet_convert import (
    attributes_dict,
    backends_pb,
    device_pb,
    preview_pb,
    rollout_pb,
    timestamp,
)
from control_plane.api.grpc_errors import mapped
from control_plane.api.telemetry_convert import install_pb, latency_pb
from control_plane.fleet.devices import Fleet, validate_device_id
from control_plane.fleet.writer import DeviceWriter
from control_plane.id_prefix import only_match
from control_plane.registry.contract import default_variant, variant_needs
from control_plane.registry.requests import MAX_VERSION, VARIANT_NAME, validate_name
from control_plane.rollouts.fit import misfit
from control_plane.rollouts.guard import Guard
from control_plane.rollouts.lifecycle import stage_index
from control_plane.rollouts.resolver import Resolver, Snapshot
from control_plane.rollouts.service import ROLLOUT_PREFIX, Rollouts, RolloutSpec
from control_plane.rollouts.watchers import Watchers
from control_plane.store.base import RegistryStore
from control_plane.store.fleet import DeviceRecord
from control_plane.store.rollouts import RolloutRecord
from control_plane.telemetry import Telemetry
from control_plane.telemetry.recommend import Recommendations
from protos import fleet_pb2, fleet_pb2_grpc

# The characters of a rollout id (`ro_` and lowercase hex): any start of one names it.
_ID_START = re.compile(r"[0-9a-z_]{1,32}")


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
        return self.add_telemetry(self.device_pb(d))

    def add_telemetry(self, msg: fleet_pb2.Device) -> fleet_pb2.Device:
        """Add its recent installs and latency per model to a device's message; return it."""
        msg.recent_installs.extend(install_pb(i) for i in self._telemetry.recent_installs(msg.id))
        msg.latency.extend(latency_pb(x) for x in self._telemetry.latency(msg.id))
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

    def page(
        self, selector: str, page_size: int = 0, page_token: str = ""
    ) -> tuple[list[fleet_pb2.Device], str]:
        """Return one page of the devices a selector picks, and the next page's token.

        What ListDevices answers, and the dashboard's devices page reads: a token
        continues the listing of one selector only (hashed: selectors are long).
        """
        scope = "devices:" + hashlib.sha256(selector.encode()).hexdigest()[:16]
        page = paging.page_request(page_size, page_token, scope=scope, parse_key=validate_device_id)
        records = self.list(selector, after=page.after or "", limit=page.size + 1)
        snap = self.snapshot()
        return paging.next_page(
            [self.device_pb(d, snap) for d in records],
            page,
            key=lambda d: d.id,
            byte_size=lambda d: d.ByteSize(),
        )


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
        preview = self._fit_preview(request) if request.fit_model else None
        devices, token = self._view.page(request.selector, request.page_size, request.page_token)
        response = fleet_pb2.ListDevicesResponse(devices=devices, next_page_token=token)
        if preview is not None:
            variant, needs = preview
            response.fit_variant = variant
            for d in devices:
                found = misfit(needs, wire_attributes(d.attributes))
                if found is not None:
                    response.misfits[d.id].reason, response.misfits[d.id].detail = found
        return response

    def _fit_preview(self, request) -> tuple[str, dict]:
        """Return the variant a fit preview is of, and what it needs of a device."""
        validate_name(request.fit_model)
        if not 1 <= request.fit_version <= MAX_VERSION:
            raise errors.InvalidArgument(f"fit version must be 1 to {MAX_VERSION}")
        if request.fit_variant and not VARIANT_NAME.fullmatch(request.fit_variant):
            raise errors.InvalidArgument(f"invalid variant {request.fit_variant!r:.40}")
        record = self._registry.get_version(request.fit_model, request.fit_version)
        have = [v.name for v in record.variants]
        variant = request.fit_variant or default_variant(have)
        if variant not in have:
            raise errors.NotFound(
                f"{request.fit_model}:{request.fit_version} has no variant {variant!r} "
                f"(it has {', '.join(have)})"
            )
        try:
            manifest = json.loads(record.manifest)
        except ValueError:
            manifest = {}
        return variant, variant_needs(manifest if isinstance(manifest, dict) else {}, variant)

    @mapped
    def GetDevice(self, request, context):  # noqa: D102, N802
        _actor()
        # Any unique prefix of an id names its device (`skiff fleet show dev_3f`).
        return self._view.device_detail_pb(self._view.get(self._view.fleet.resolve(request.id)))

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
        msg = rollout_pb(
            record,
            self._rollouts.counts(record),
            self._guard.health(record),
            variant=self._rollouts.variant_of(record),
        )
        full, deltas = self._rollouts.download_bytes(record)
        msg.download_bytes = full
        msg.download_bytes_from.update(deltas)
        return msg

    def get(self, rollout_id: str) -> fleet_pb2.Rollout:
        """Return one rollout with its counts and health: `rollout_id` or a unique prefix."""
        return self.with_counts(self._find(rollout_id))

    def _find(self, text: str) -> RolloutRecord:
        """Return the rollout whose id is `text`, or the one whose id alone starts with it.

        Any unique prefix names its rollout, as for devices (`skiff rollout show ro_9a`);
        see `control_plane.id_prefix` for an unknown or ambiguous one.
        """
        starts_like_one = isinstance(text, str) and (
            ROLLOUT_PREFIX.startswith(text) or text.startswith(ROLLOUT_PREFIX)
        )
        if not (starts_like_one and _ID_START.fullmatch(text)):
            raise errors.InvalidArgument(f"invalid rollout id {text!r:.40}: expected ro_...")
        if text.startswith(ROLLOUT_PREFIX):
            try:
                return self._rollouts.get(text)
            except errors.NotFound:
                pass  # the start of an id, perhaps
        ids = [r.id for r in self._rollouts.list() if r.id.startswith(text)]
        return self._rollouts.get(only_match("rollout", text, ids))

    def list(self, model: str = "") -> list[fleet_pb2.Rollout]:
        """Return every rollout (of `model`, if given), without counts."""
        return [
            rollout_pb(r, variant=self._rollouts.variant_of(r)) for r in self._rollouts.list(model)
        ]

    def create(self, spec: RolloutSpec, *, actor: str, dry_run: bool = False) -> fleet_pb2.Rollout:
        """Create a rollout; with `dry_run`, the one it would be and its preview, unstored."""
        if dry_run:
            self._view.flush()  # count the devices this replica has just heard from too
            record, found = self._rollouts.preview(spec, actor=actor)
            msg = rollout_pb(record, variant=self._rollouts.variant_of(record))
            msg.id = ""  # nothing was created: no id to act on
            msg.preview.CopyFrom(preview_pb(found))
            return msg
        created = self._rollouts.create(spec, actor=actor)
        return rollout_pb(created, variant=self._rollouts.variant_of(created))

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
        """Pause, resume, promote or roll back (a slice of) a rollout, as `actor`.

        `expected_stage` is numbered from 1, as every message and document has it.
        """
        index = None
        if expected_stage is not None:
            n_stages = len(self._rollouts.get(rollout_id).stages)
            index = stage_index(expected_stage, n_stages)
        record = self._rollouts.transition(
            rollout_id,
            action,
            actor=actor,
            reason=reason,
            expected_stage=index,
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
            download_on=request.download_on,
            download_while=request.download_while,
            allow_empty=request.allow_empty,
            allow_degraded=request.allow_degraded,
        )
        return self._ops.create(spec, actor=actor, dry_run=request.dry_run)

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
