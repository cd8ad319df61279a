"""The JSON documents of models and their versions, from the registry's messages.

What `skiff model ls/show --json` prints and what the dashboard's model pages and
`/api/v1/models` show: one mapping per document, whichever surface shows it.
"""

from __future__ import annotations

import base64
import json

from google.protobuf.json_format import MessageToDict

from control_plane.registry import accuracy_bars
from protos import common_pb2


def iso(ts) -> str:
    """Return a Timestamp to the second in ISO 8601 with Z (1970-01-01 when unset)."""
    return ts.ToDatetime().replace(microsecond=0).isoformat() + "Z"


def model_dict(m: common_pb2.Model) -> dict:
    """JSON-ready form of a model."""
    return {
        "name": m.name,
        "latest_version": m.latest_version,
        "version_count": m.version_count,
        "created_at": iso(m.created_at),
    }


def version_dict(v: common_pb2.ModelVersion) -> dict:
    """JSON-ready form of a version: the manifest parsed, its signature base64."""
    body = MessageToDict(
        v, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    body["version"] = v.version
    body["created_at"] = iso(v.created_at)
    _int_shapes(body["signature"], v.signature)
    for variant, msg in zip(body["variants"], v.variants, strict=True):
        _int_shapes(variant["signature"], msg.signature)
        variant["plaintext_size"] = msg.plaintext_size
        variant["ciphertext_size"] = msg.ciphertext_size
        variant["segment_size"] = msg.segment_size
        if not msg.HasField("accuracy"):
            variant["accuracy"] = None
        elif msg.accuracy.min_top1:  # a language model's: the tensor figures do not apply
            variant["accuracy"] = {
                "top1_agreement": msg.accuracy.top1_agreement,
                "mean_kl": msg.accuracy.mean_kl,
                "min_top1": msg.accuracy.min_top1,
                "positions": msg.accuracy.positions,
            }
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
    body["pipeline"] = pipeline(v)
    body["manifest_signature"] = base64.b64encode(v.manifest_signature).decode()
    return body


def pipeline(v: common_pb2.ModelVersion) -> dict | None:
    """Return the version's event pipeline from its manifest (None: none, or unreadable)."""
    try:
        manifest = json.loads(v.manifest) if v.manifest else {}
    except ValueError:
        return None
    pipeline = manifest.get("pipeline") if isinstance(manifest, dict) else None
    return pipeline if isinstance(pipeline, dict) else None


_LLM_INTS = ("vocab_size", "context_length", "layers", "hidden_size", "memory_mb", "disk_mb")


def _int_shapes(body: dict, signature: common_pb2.ModelSignature) -> None:
    """Put shapes back as JSON numbers (protobuf's JSON writes int64 as strings)."""
    if signature.HasField("llm"):
        for key in _LLM_INTS:
            body["llm"][key] = getattr(signature.llm, key)
    else:
        body.pop("llm", None)
    for kind in ("inputs", "outputs"):
        for spec, msg in zip(body.get(kind, []), getattr(signature, kind), strict=True):
            spec["shape"] = list(msg.shape)
