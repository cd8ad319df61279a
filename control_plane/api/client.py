"""Admin client: the one module that owns the CLI's networking.

Unary reads retry only on UNAVAILABLE, with exponential backoff and full jitter; auth
errors fail fast. Every call carries a deadline. Pushes are not retried automatically:
a retried push would append a second version.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import grpc

from contract import errors
from contract.attribute_messages import attributes_pb
from contract.pinned_keys import PinnedKeyRing
from contract.transport import (
    ClientTls,
    address_problem,
    channel_credentials,
    retry_helps,
    unreachable,
)
from control_plane.api.grpc_errors import error_for
from control_plane.api.transfer import (
    Progress,
    push_requests,
    read_golden,
    size_and_digest,
    write_verified,
)
from control_plane.api.trust import signed_golden, signed_variant, verify_version
from protos import admin_pb2, admin_pb2_grpc, common_pb2, fleet_pb2, fleet_pb2_grpc

UNARY_DEADLINE_S = 30.0
# Streams move up to gigabytes; the deadline guards against a stalled peer, not a slow one.
STREAM_DEADLINE_S = 6 * 3600.0
RETRIES = 4
BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 5.0

CHANNEL_OPTIONS = [
    # Matches the server's limit; chunks are 1 MiB.
    ("grpc.max_receive_message_length", 8 << 20),
    ("grpc.max_send_message_length", 8 << 20),
    # Long uploads sit idle on the response side; keepalive pings stop NATs and proxies
    # from dropping the connection under them.
    ("grpc.keepalive_time_ms", 30_000),
    # A peer that misses a ping for this long is gone; fail the call instead of hanging.
    ("grpc.keepalive_timeout_ms", 10_000),
]


def rpc_error(
    exc: grpc.RpcError, *, address: str = "", plaintext: bool = False
) -> errors.SkiffError:
    """Turn a gRPC error into the matching domain error, keeping the server's message.

    A call that never reached the server says why in one line, as the agent does
    (`contract.transport.unreachable`: the CA, the port, the host name...).
    """
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = (exc.details() if hasattr(exc, "details") else "") or code.name.lower()
    if code == grpc.StatusCode.UNAVAILABLE:
        details = unreachable(address, details, plaintext=plaintext) or details
    return error_for(code)(details)


class PushCancelled(KeyboardInterrupt):
    """Ctrl-C during a push: the call is cancelled; the message says what the server keeps.

    A stream cut short can never be stored (the header declares its size and SHA-256);
    once every byte is sent, the server stores nothing unless it had already committed.
    """

    def __init__(self, name: str, *, complete: bool) -> None:
        if complete:
            super().__init__(
                "push cancelled after the upload: the server stores nothing unless it had "
                f"already finished (`skiff model show {name}` says)"
            )
        else:
            super().__init__("push cancelled: nothing stored (the upload was cut short)")


class AdminClient:
    """Typed wrapper over AdminService."""

    def __init__(self, address: str, token: str, tls: ClientTls | None = None) -> None:
        if problem := address_problem(address):
            raise errors.InvalidArgument(problem)
        self._address = address
        credentials = channel_credentials(address, tls)
        self._plaintext = credentials is None
        if credentials is None:
            self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            self._channel = grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
        self._stub = admin_pb2_grpc.AdminServiceStub(self._channel)
        self._fleet = fleet_pb2_grpc.FleetServiceStub(self._channel)
        self._rollouts = fleet_pb2_grpc.RolloutServiceStub(self._channel)
        self._metadata = (("authorization", f"Bearer {token}"),)

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _error(self, exc: grpc.RpcError) -> errors.SkiffError:
        return rpc_error(exc, address=self._address, plaintext=self._plaintext)

    def _unary(self, method, request):
        for attempt in range(RETRIES + 1):
            try:
                return method(request, timeout=UNARY_DEADLINE_S, metadata=self._metadata)
            except grpc.RpcError as exc:
                retry = exc.code() == grpc.StatusCode.UNAVAILABLE and attempt < RETRIES
                # A certificate that failed to verify fails again: do not wait it out.
                if not retry or not retry_helps(exc.details() or ""):
                    raise self._error(exc) from None
                time.sleep(random.uniform(0, min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)))
        raise AssertionError("unreachable")

    def list_models(self, limit: int | None = None) -> list[common_pb2.Model]:
        """Return every model (at most `limit`), reading page after page."""
        return list(self.models_page(limit).models)

    def models_page(self, limit: int | None = None) -> admin_pb2.ListModelsResponse:
        """Return up to `limit` models (None: all) as one response.

        Its next_page_token is set when more models exist beyond `limit`.
        """
        merged = admin_pb2.ListModelsResponse()
        while True:
            request = admin_pb2.ListModelsRequest(
                page_size=_page_size(limit, len(merged.models)),
                page_token=merged.next_page_token,
            )
            page = self._unary(self._stub.ListModels, request)
            merged.models.extend(page.models)
            merged.next_page_token = page.next_page_token
            if not page.next_page_token or _full(limit, len(merged.models)):
                return merged

    def get_model(
        self, name: str, version: int | None = None, *, limit: int | None = None
    ) -> admin_pb2.GetModelResponse:
        """Return a model with one version, or its versions (at most `limit`, oldest first).

        Reads page after page; next_page_token is set when versions exist beyond `limit`.
        """
        merged = admin_pb2.GetModelResponse()
        while True:
            request = admin_pb2.GetModelRequest(
                name=name,
                version=version or 0,
                page_size=_page_size(limit, len(merged.versions)),
                page_token=merged.next_page_token,
            )
            page = self._unary(self._stub.GetModel, request)
            merged.model.CopyFrom(page.model)
            merged.versions.extend(page.versions)
            merged.next_page_token = page.next_page_token
            if not page.next_page_token or _full(limit, len(merged.versions)):
                return merged

    def rotate_kek(self, new_kek: str = "") -> admin_pb2.RotateKekResponse:
        """Re-wrap every data key under a new KEK."""
        return self._unary(self._stub.RotateKek, admin_pb2.RotateKekRequest(new_kek=new_kek))

    def collect_garbage(self, *, dry_run: bool = False) -> admin_pb2.CollectGarbageResponse:
        """Delete (or, on a dry run, list) unreferenced blobs past the grace period."""
        # Retried like a read: a repeated sweep deletes nothing the first one did not.
        request = admin_pb2.CollectGarbageRequest(dry_run=dry_run)
        return self._unary(self._stub.CollectGarbage, request)

    # -- API tokens -------------------------------------------------------------------------

    def create_api_token(
        self, *, role: str, name: str = "", ttl_s: int = 0
    ) -> admin_pb2.CreateApiTokenResponse:
        """Make an API token (the secret is in the response, shown once)."""
        request = admin_pb2.CreateApiTokenRequest(role=role, name=name, ttl_s=ttl_s)
        return self._unary(self._stub.CreateApiToken, request)

    def list_api_tokens(self, *, include_inactive: bool = False) -> list[admin_pb2.ApiToken]:
        """Return the API tokens (revoked and expired ones too with include_inactive)."""
        request = admin_pb2.ListApiTokensRequest(all=include_inactive)
        return list(self._unary(self._stub.ListApiTokens, request).tokens)

    def revoke_api_token(self, token_id: str) -> admin_pb2.ApiToken:
        """Revoke an API token at once."""
        return self._unary(self._stub.RevokeApiToken, admin_pb2.RevokeApiTokenRequest(id=token_id))

    def get_signing_keys(self) -> list[common_pb2.SigningKey]:
        """Return the signing-key chain, oldest first (unverified: walk it from pins)."""
        request = admin_pb2.GetSigningKeysRequest()
        return list(self._unary(self._stub.GetSigningKeys, request).keys)

    def rotate_signing_key(
        self, new_key: str = "", overlap_s: int = 0
    ) -> admin_pb2.RotateSigningKeyResponse:
        """Make a new signing key active (not retried: a retry would rotate twice)."""
        request = admin_pb2.RotateSigningKeyRequest(new_key=new_key, overlap_s=overlap_s)
        try:
            return self._stub.RotateSigningKey(
                request, timeout=UNARY_DEADLINE_S, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    # -- fleet ------------------------------------------------------------------------------

    def create_enrollment_token(
        self, *, ttl_s: int = 0, uses: int = 0, attributes: dict | None = None, name: str = ""
    ) -> fleet_pb2.CreateEnrollmentTokenResponse:
        """Make an enrollment token (the secret is in the response, shown once)."""
        request = fleet_pb2.CreateEnrollmentTokenRequest(
            ttl_s=ttl_s, uses=uses, attributes=attributes_pb(attributes or {}), name=name
        )
        return self._unary(self._fleet.CreateEnrollmentToken, request)

    def list_devices(
        self, selector: str = "", *, limit: int | None = None
    ) -> list[fleet_pb2.Device]:
        """Return the devices a selector picks (all of them by default), by id."""
        return list(self.devices_page(selector, limit).devices)

    def devices_page(
        self,
        selector: str = "",
        limit: int | None = None,
        *,
        fit: tuple[str, int, str] | None = None,
    ) -> fleet_pb2.ListDevicesResponse:
        """Return up to `limit` devices (None: all) as one response, reading page by page.

        Its next_page_token is set when more devices exist beyond `limit`. With `fit`
        (model, version, variant; "" = the default), it also says which devices could not
        run that variant (`misfits`).
        """
        merged = fleet_pb2.ListDevicesResponse()
        model, version, variant = fit or ("", 0, "")
        while True:
            request = fleet_pb2.ListDevicesRequest(
                selector=selector,
                page_size=_page_size(limit, len(merged.devices)),
                page_token=merged.next_page_token,
                fit_model=model,
                fit_version=version,
                fit_variant=variant,
            )
            page = self._unary(self._fleet.ListDevices, request)
            merged.devices.extend(page.devices)
            for device_id, why in page.misfits.items():
                merged.misfits[device_id].CopyFrom(why)
            merged.fit_variant = page.fit_variant
            merged.next_page_token = page.next_page_token
            if not page.next_page_token or _full(limit, len(merged.devices)):
                return merged

    def get_device(self, device_id: str) -> fleet_pb2.Device:
        """Return one device: `device_id` is its id or any unique prefix of it."""
        return self._unary(self._fleet.GetDevice, fleet_pb2.GetDeviceRequest(id=device_id))

    def get_backends(
        self, model: str, version: int, variant: str = ""
    ) -> fleet_pb2.GetBackendsResponse:
        """Return a version's backend configs per device class, from fleet telemetry."""
        request = fleet_pb2.GetBackendsRequest(model=model, version=version, variant=variant)
        return self._unary(self._fleet.GetBackends, request)

    def revoke_device(self, device_id: str, reason: str = "") -> fleet_pb2.Device:
        """Refuse a device from now on."""
        request = fleet_pb2.RevokeDeviceRequest(id=device_id, reason=reason)
        return self._unary(self._fleet.RevokeDevice, request)

    # -- rollouts ---------------------------------------------------------------------------

    def create_rollout(self, request: fleet_pb2.CreateRolloutRequest) -> fleet_pb2.Rollout:
        """Create a rollout (not retried: a retry could create a second one)."""
        try:
            return self._rollouts.CreateRollout(
                request, timeout=UNARY_DEADLINE_S, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def list_rollouts(self, model: str = "") -> list[fleet_pb2.Rollout]:
        """Return rollouts, oldest first."""
        request = fleet_pb2.ListRolloutsRequest(model=model)
        return list(self._unary(self._rollouts.ListRollouts, request).rollouts)

    def get_rollout(self, rollout_id: str) -> fleet_pb2.Rollout:
        """Return one rollout with its audit log and counts.

        `rollout_id` is its id or any unique prefix of it (the server resolves it: see
        `control_plane.id_prefix` for what an unknown or ambiguous one raises).
        """
        return self._unary(self._rollouts.GetRollout, fleet_pb2.GetRolloutRequest(id=rollout_id))

    def transition_rollout(
        self,
        rollout_id: str,
        action: str,
        reason: str = "",
        *,
        expected_stage: int | None = None,
        slice: str = "",
    ) -> fleet_pb2.Rollout:
        """Pause, resume, promote or roll back (not retried: the state may have moved).

        With `expected_stage`, the server applies it only if the rollout is still there;
        with `slice` ("soc=X"), resume and rollback act on that slice only.
        """
        request = fleet_pb2.TransitionRolloutRequest(
            id=rollout_id,
            action=action,
            reason=reason,
            expected_stage=expected_stage,
            slice=slice,
        )
        try:
            return self._rollouts.TransitionRollout(
                request, timeout=UNARY_DEADLINE_S, metadata=self._metadata
            )
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    # -- models -----------------------------------------------------------------------------

    def push(
        self,
        path: str | os.PathLike,
        *,
        name: str,
        notes: str = "",
        variants: tuple[str, ...] = (),
        progress: Progress | None = None,
        golden: str | os.PathLike | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        input_ranges: Mapping[str, tuple[float, float]] | None = None,
        min_cosine: float = 0.0,
        allow_degraded: bool = False,
        pipeline: str | Mapping | None = None,
        allow_duplicate: bool = False,
        filename: str | None = None,
    ) -> common_pb2.ModelVersion:
        """Stream a model file (and golden inputs, if given) to the registry.

        Returns the new version. `input_shapes` and `input_ranges` shape the seeded golden
        inputs the server builds when `golden` is None; `min_cosine` (0 = the server's
        default) is the bar derived variants must reach, unless `allow_degraded`.
        `pipeline` is the version's event pipeline (`runtime.pipeline`: JSON text or data).
        A file whose bytes are the model's latest version's is refused (FailedPrecondition,
        before it is uploaded) unless `allow_duplicate`. `filename` is the name the
        registry is told (default: the path's).
        """
        path = Path(path)
        try:
            size, digest = size_and_digest(path)
        except KeyboardInterrupt:
            raise PushCancelled(name, complete=False) from None
        golden_data = read_golden(Path(golden)) if golden is not None else b""
        header = admin_pb2.PushHeader(
            name=name,
            notes=notes,
            variants=list(variants),
            filename=filename or path.name,
            size=size,
            sha256=digest,
            golden_size=len(golden_data),
            input_shapes=[
                admin_pb2.InputShape(name=k, shape=list(v)) for k, v in (input_shapes or {}).items()
            ],
            input_ranges=[
                admin_pb2.InputRange(name=k, low=lo, high=hi)
                for k, (lo, hi) in (input_ranges or {}).items()
            ],
            min_cosine=min_cosine,
            allow_degraded=allow_degraded,
            pipeline=_pipeline_text(pipeline),
            allow_duplicate=allow_duplicate,
        )
        sent = [0]

        def counted(done: int, total: int) -> None:
            sent[0] = done
            if progress:
                progress(done, total)

        call = self._stub.PushModel.future(
            push_requests(path, header, counted, golden_data),
            timeout=STREAM_DEADLINE_S,
            metadata=self._metadata,
        )
        try:
            return call.result()
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        except KeyboardInterrupt:
            call.cancel()  # the server sees its client go and stores nothing from now on
            raise PushCancelled(name, complete=sent[0] >= size) from None

    def pull(
        self,
        name: str,
        version: int | None,
        out: str | os.PathLike,
        *,
        pins: PinnedKeyRing,
        variant: str = "",
        progress: Progress | None = None,
        golden: bool = False,
    ) -> admin_pb2.PullHeader:
        """Download a decrypted variant to `out`: verified, then renamed into place.

        The version's manifest must verify under `pins` and name what was asked for; the
        bytes written must match the size and digest that manifest signs. With `golden`,
        the version's golden data is pulled instead of a variant.
        """
        try:
            header, expected, responses = self._open_pull(name, version, pins, variant, golden)
            with _cancelled_on_error(responses):
                write_verified(responses, Path(out), expected, progress)
            return header
        except grpc.RpcError as exc:
            raise self._error(exc) from None

    def pull_bytes(
        self,
        name: str,
        version: int | None,
        *,
        pins: PinnedKeyRing,
        variant: str = "",
        golden: bool = False,
    ) -> tuple[admin_pb2.PullHeader, bytes]:
        """Like `pull`, into memory: for callers that must not put plaintext on disk."""
        try:
            header, (want_size, want_sha256), responses = self._open_pull(
                name, version, pins, variant, golden
            )
            with _cancelled_on_error(responses):
                data = b"".join(r.chunk for r in responses)
        except grpc.RpcError as exc:
            raise self._error(exc) from None
        if len(data) != want_size or hashlib.sha256(data).hexdigest() != want_sha256:
            raise errors.IntegrityError(
                f"downloaded data does not match its signed manifest ({len(data)} bytes)"
            )
        return header, data

    def _open_pull(self, name, version, pins, variant, golden):
        """Start a pull; return its verified header, the signed (size, SHA-256), the rest."""
        request = admin_pb2.PullModelRequest(
            name=name, version=version or 0, variant=variant, golden=golden
        )
        responses = self._stub.PullModel(
            request, timeout=STREAM_DEADLINE_S, metadata=self._metadata
        )
        with _cancelled_on_error(responses):
            header = next(responses).header
            verified = verify_version(pins, header.version, model=name, number=version)
            if golden:
                expected = signed_golden(verified)
            else:
                expected = signed_variant(verified, variant, header.variant.name)
        return header, expected, responses


@contextlib.contextmanager
def _cancelled_on_error(call) -> Iterator[None]:
    """Cancel a server stream the caller stops reading because something went wrong.

    Left open, the server's handler would wait on flow control until the deadline (hours)
    and keep one of its threads, which a server stop then cannot get back.
    """
    try:
        yield
    except BaseException:
        call.cancel()
        raise


def _page_size(limit: int | None, have: int) -> int:
    # 0 lets the server pick (its default page size); it caps larger requests itself.
    return 0 if limit is None else limit - have


def _full(limit: int | None, have: int) -> bool:
    return limit is not None and have >= limit


def _pipeline_text(pipeline: str | Mapping | None) -> str:
    """Return a pipeline spec as the JSON text a push header carries ("" = none)."""
    if pipeline is None or isinstance(pipeline, str):
        return pipeline or ""
    return json.dumps(pipeline)
