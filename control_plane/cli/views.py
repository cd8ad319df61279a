"""Human and JSON renderings of registry messages for the CLI."""

from __future__ import annotations

import base64
import json

from google.protobuf.json_format import MessageToDict

from control_plane.registry import accuracy_bars
from protos import common_pb2


def _ts(ts) -> str:
    return ts.ToDatetime().replace(microsecond=0).isoformat() + "Z"


def model_dict(m: common_pb2.Model) -> dict:
    """JSON-ready form of a model."""
    return {
        "name": m.name,
        "latest_version": m.latest_version,
        "version_count": m.version_count,
        "created_at": _ts(m.created_at),
    }


def version_dict(v: common_pb2.ModelVersion) -> dict:
    """JSON-ready form of a version: the manifest parsed, its signature base64."""
    body = MessageToDict(
        v, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    body["version"] = v.version
    body["created_at"] = _ts(v.created_at)
    _int_shapes(body["signature"], v.signature)
    for variant, msg in zip(body["variants"], v.variants, strict=True):
        _int_shapes(variant["signature"], msg.signature)
        variant["plaintext_size"] = msg.plaintext_size
        variant["ciphertext_size"] = msg.ciphertext_size
        variant["segment_size"] = msg.segment_size
        if not msg.HasField("accuracy"):
            variant["accuracy"] = None
        variant.update(accuracy_bars.variant_status(msg.degraded, msg.accuracy))
    if v.HasField("golden"):
        for key in ("ciphertext_size", "plaintext_size", "segment_size"):
            body["golden"][key] = getattr(v.golden, key)
    else:
        body["golden"] = None
    try:  # shown as the server sent it; whether it is trusted is `signature_verified`
        body["manifest"] = json.loads(v.manifest) if v.manifest else None
    except ValueError:
        body["manifest"] = None
    body["pipeline"] = _pipeline(v)
    body["manifest_signature"] = base64.b64encode(v.manifest_signature).decode()
    return body


def _pipeline(v: common_pb2.ModelVersion) -> dict | None:
    """Return the version's event pipeline from its manifest (None: none, or unreadable)."""
    try:
        manifest = json.loads(v.manifest) if v.manifest else {}
    except ValueError:
        return None
    pipeline = manifest.get("pipeline") if isinstance(manifest, dict) else None
    return pipeline if isinstance(pipeline, dict) else None


def _int_shapes(body: dict, signature: common_pb2.ModelSignature) -> None:
    """Put shapes back as JSON numbers (protobuf's JSON writes int64 as strings)."""
    for kind in ("inputs", "outputs"):
        for spec, msg in zip(body.get(kind, []), getattr(signature, kind), strict=True):
            spec["shape"] = list(msg.shape)


def _dims(shape) -> str:
    return "x".join("?" if d < 0 else str(d) for d in shape) or "scalar"


def _tensors(specs) -> str:
    return ", ".join(f"{t.name}[{_dims(t.shape)}] {t.dtype}" for t in specs)


def models_table(models: list[common_pb2.Model]) -> str:
    """Render models as a plain table."""
    if not models:
        return "no models yet: push one with `skiff model push FILE --name NAME`"
    rows = [("NAME", "LATEST", "VERSIONS", "CREATED")]
    rows += [
        (m.name, str(m.latest_version), str(m.version_count), _ts(m.created_at)) for m in models
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows
    )


def version_text(v: common_pb2.ModelVersion, *, signed_by: str = "", unverified: str = "") -> str:
    """Describe one version for people; "signed by" only for a signature checked by the CLI."""
    signature = f"signed by {signed_by}" if signed_by else f"signature NOT verified: {unverified}"
    lines = [
        f"{v.model}:{v.version}",
        f"  created   {_ts(v.created_at)} by {v.created_by}",
        f"  source    {v.source_format}, MNN {v.signature.mnn_version}",
        f"  inputs    {_tensors(v.signature.inputs)}",
        f"  outputs   {_tensors(v.signature.outputs)}",
        f"  manifest  {signature}",
    ]
    if v.notes:
        lines.insert(2, f"  notes     {v.notes}")
    if v.HasField("golden"):
        source = "the publisher's inputs" if v.golden.source == "publisher" else "seeded inputs"
        lines.append(f"  golden    {source}, {v.golden.plaintext_size:,} B (encrypted)")
    pipeline = _pipeline(v)
    if pipeline:
        triggers = ", ".join(f"{t['name']} ({t['pattern']})" for t in pipeline["triggers"])
        events = ", ".join(pipeline["event_types"])
        lines.append(f"  pipeline  events {events}; triggers {triggers}")
    lines.append("  variants")
    for var in v.variants:
        lines.append(
            f"    {var.name:<5} {var.plaintext_size:>12,} B  sha256 {var.plaintext_sha256[:16]}…"
            f"  encrypted {var.ciphertext_size:,} B{_accuracy(var)}"
        )
        if var.HasField("accuracy") and len(var.accuracy.outputs) > 1:
            for out in var.accuracy.outputs:
                lines.append(
                    f"          {out.name}: cosine {out.cosine:.4f}, relative error "
                    f"{out.relative_error:.3g}, max abs error {out.max_abs_error:.3g}"
                )
    return "\n".join(lines)


def _accuracy(var: common_pb2.Variant) -> str:
    """Say how a derived variant compares with fp32 (nothing for fp32 itself)."""
    if not var.HasField("accuracy"):
        return ""
    a = var.accuracy
    verdict = f"  {accuracy_bars.degraded_label(a)}" if var.degraded else ""
    return (
        f"  vs fp32: cosine {a.cosine:.4f}, relative error {a.relative_error:.3g}, "
        f"max abs error {a.max_abs_error:.3g}{verdict}"
    )
