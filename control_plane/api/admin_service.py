"""AdminService servicer: authenticates, converts messages, calls the registry."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from control_plane import errors
from control_plane.api.auth import Authenticator
from control_plane.api.grpc_errors import mapped, mapped_stream
from control_plane.api.signing_convert import chain_pb, signing_key_pb
from control_plane.registry.registry import PushRequest, Registry
from control_plane.store.base import ModelRecord, VariantRecord, VersionRecord
from protos import admin_pb2, admin_pb2_grpc, common_pb2

PULL_CHUNK = 1 << 20


def _timestamp(value) -> Timestamp:
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def signature_pb(sig: dict) -> common_pb2.ModelSignature:
    """Convert a stored signature dict to its message."""
    return common_pb2.ModelSignature(
        inputs=[common_pb2.TensorSpec(**t) for t in sig.get("inputs", [])],
        outputs=[common_pb2.TensorSpec(**t) for t in sig.get("outputs", [])],
        mnn_version=sig.get("mnn_version", ""),
    )


def variant_pb(v: VariantRecord) -> common_pb2.Variant:
    """Convert a variant record to its message."""
    return common_pb2.Variant(
        name=v.name,
        plaintext_size=v.plaintext_size,
        plaintext_sha256=v.plaintext_sha256,
        ciphertext_size=v.ciphertext_size,
        ciphertext_sha256=v.ciphertext_sha256,
        segment_size=v.segment_size,
        signature=signature_pb(v.signature),
    )


def version_pb(r: VersionRecord) -> common_pb2.ModelVersion:
    """Convert a version record to its message."""
    return common_pb2.ModelVersion(
        model=r.model,
        version=r.number,
        created_at=_timestamp(r.created_at),
        created_by=r.created_by,
        notes=r.notes,
        source_format=r.source_format,
        signature=signature_pb(r.signature),
        variants=[variant_pb(v) for v in r.variants],
        manifest=r.manifest,
        manifest_signature=r.manifest_signature,
        signing_key_id=r.signing_key_id,
    )


def model_pb(m: ModelRecord) -> common_pb2.Model:
    """Convert a model record to its message."""
    return common_pb2.Model(
        name=m.name,
        created_at=_timestamp(m.created_at),
        latest_version=m.latest_version,
        version_count=m.version_count,
    )


class _Upload:
    """The chunk stream of a PushModel call; only a stream that really ended is complete."""

    def __init__(self, requests: Iterator, header: admin_pb2.PushHeader, context, limit: int):
        if header.size > limit:
            raise errors.TooLarge(f"model is {header.size} bytes, over the {limit}-byte limit")
        self._requests = requests
        # The call's done-callbacks run only when it ends; before we answer, that means
        # the client went away (cancelled, or the connection dropped).
        self._ended = threading.Event()
        context.add_callback(self._ended.set)

    def __iter__(self) -> Iterator[bytes]:
        for request in self._requests:
            if request.WhichOneof("item") != "chunk":
                raise errors.InvalidArgument("PushModel: only the first message is a header")
            yield request.chunk
        # A cancelled call can end the iterator early; never store a cut-off upload.
        if self._ended.is_set():
            raise errors.Unavailable("client disconnected mid-upload")


class AdminServicer(admin_pb2_grpc.AdminServiceServicer):
    """Thin gRPC adapter over the registry; every call needs the admin token."""

    def __init__(self, registry: Registry, authenticator: Authenticator, *, kek_factory):
        self._registry = registry
        self._auth = authenticator
        self._kek_factory = kek_factory

    def _actor(self, context: grpc.ServicerContext) -> str:
        metadata = dict(context.invocation_metadata())
        return self._auth.authenticate(metadata.get("authorization")).name

    @mapped
    def PushModel(self, request_iterator, context):  # noqa: D102, N802
        actor = self._actor(context)
        first = next(request_iterator, None)
        if first is None or first.WhichOneof("item") != "header":
            raise errors.InvalidArgument("PushModel: the first message must be a header")
        header = first.header
        upload = _Upload(request_iterator, header, context, self._registry.max_model_bytes)
        record = self._registry.push(
            PushRequest(
                name=header.name,
                actor=actor,
                notes=header.notes,
                variants=tuple(header.variants),
                filename=header.filename,
                size=header.size,
                sha256=header.sha256,
            ),
            upload,
        )
        return version_pb(record)

    @mapped
    def ListModels(self, request, context):  # noqa: D102, N802
        self._actor(context)
        return admin_pb2.ListModelsResponse(
            models=[model_pb(m) for m in self._registry.list_models()]
        )

    @mapped
    def GetModel(self, request, context):  # noqa: D102, N802
        self._actor(context)
        model, versions = self._registry.show(request.name, request.version or None)
        return admin_pb2.GetModelResponse(
            model=model_pb(model), versions=[version_pb(v) for v in versions]
        )

    @mapped_stream
    def PullModel(self, request, context):  # noqa: D102, N802
        self._actor(context)
        record, variant, plaintext = self._registry.pull(
            request.name, request.version or None, request.variant
        )
        yield admin_pb2.PullModelResponse(
            header=admin_pb2.PullHeader(version=version_pb(record), variant=variant_pb(variant))
        )
        for chunk in plaintext:
            yield admin_pb2.PullModelResponse(chunk=chunk)

    @mapped
    def RotateKek(self, request, context):  # noqa: D102, N802
        self._actor(context)
        old_id, new_id, count = self._registry.rotate_kek(self._kek_factory(request.new_kek))
        return admin_pb2.RotateKekResponse(old_kek_id=old_id, new_kek_id=new_id, rewrapped=count)

    @mapped
    def GetSigningKeys(self, request, context):  # noqa: D102, N802
        self._actor(context)
        return admin_pb2.GetSigningKeysResponse(keys=chain_pb(self._registry.signer.chain()))

    @mapped
    def RotateSigningKey(self, request, context):  # noqa: D102, N802
        self._actor(context)
        previous, active, _ = self._registry.signer.rotate(request.new_key, request.overlap_s)
        return admin_pb2.RotateSigningKeyResponse(
            previous=signing_key_pb(previous, active=False),
            active=signing_key_pb(active, active=True),
        )
