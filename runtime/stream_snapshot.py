"""The stream engine's snapshot format: a checked envelope around the native state.

Layout (integers little-endian)::

    magic        8 bytes  b"SKSTREAM"
    version      u16      FORMAT_VERSION
    fingerprint  32 bytes SHA-256 of the description below, display texts left out
    description  u32 length + UTF-8 JSON: the engine's config and trigger set, canonical
    payload      u64 length + the native engine's state (runtime/_native/src/snapshot.hpp)
    checksum     16 bytes SHA-256 of everything above, truncated

The description is stored whole (it is small), so a snapshot refused for a different
trigger set says which triggers differ. Restoring checks, in order: magic, version,
lengths, checksum, fingerprint; the native side then checks the payload itself against
the compiled triggers, so damaged bytes raise `SnapshotError` and never crash.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

from runtime.stream_spec import (
    AGGREGATIONS,
    CMP_OPS,
    GAP,
    EngineConfig,
    SnapshotError,
    SnapshotMismatchError,
    TriggerSpec,
)

__all__ = ["FORMAT_VERSION", "MAGIC", "describe", "open_snapshot", "seal_snapshot"]

MAGIC = b"SKSTREAM"
FORMAT_VERSION = 1
_HEAD = struct.Struct("<8sH32sI")
_LENGTH = struct.Struct("<Q")
_CHECKSUM_BYTES = 16


def describe(config: EngineConfig, triggers: Sequence[TriggerSpec], removed: set[int]) -> str:
    """Return the canonical JSON of an engine's config and triggers (ids, specs, removals).

    Two engines get the same text iff they parse the same triggers under the same ids:
    pattern text is kept for messages only, the parsed steps are what is compared.
    """
    doc = {
        "config": _config(config),
        "triggers": [_trigger(config, t, t.id in removed) for t in triggers],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":"))


def seal_snapshot(description: str, payload: bytes) -> bytes:
    """Wrap the native payload in the checked envelope."""
    desc = description.encode()
    body = b"".join(
        (
            _HEAD.pack(MAGIC, FORMAT_VERSION, _fingerprint(description), len(desc)),
            desc,
            _LENGTH.pack(len(payload)),
            payload,
        )
    )
    return body + hashlib.sha256(body).digest()[:_CHECKSUM_BYTES]


def open_snapshot(data: object, description: str) -> bytes:
    """Check a snapshot's envelope against an engine's description; return the payload."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise SnapshotError(f"a snapshot is bytes, got {type(data).__name__}")
    data = bytes(data)
    if len(data) < _HEAD.size or not data.startswith(MAGIC):
        raise SnapshotError("not a stream engine snapshot (no SKSTREAM header)")
    _, version, fingerprint, desc_len = _HEAD.unpack_from(data)
    if version != FORMAT_VERSION:
        raise SnapshotError(
            f"snapshot format version {version}; this engine reads version {FORMAT_VERSION}"
        )
    end = _HEAD.size + desc_len + _LENGTH.size
    if end > len(data):
        raise SnapshotError(f"snapshot truncated: {len(data)} bytes")
    (payload_len,) = _LENGTH.unpack_from(data, end - _LENGTH.size)
    if len(data) != end + payload_len + _CHECKSUM_BYTES:
        raise SnapshotError(
            f"snapshot of {len(data)} bytes, its header says {end + payload_len + 16}: "
            "truncated or extended"
        )
    body = data[:-_CHECKSUM_BYTES]
    if hashlib.sha256(body).digest()[:_CHECKSUM_BYTES] != data[-_CHECKSUM_BYTES:]:
        raise SnapshotError("snapshot checksum mismatch: the bytes were damaged")
    if fingerprint != _fingerprint(description):
        theirs = data[_HEAD.size : _HEAD.size + desc_len].decode()
        raise SnapshotMismatchError(_difference(theirs, description))
    return data[end:-_CHECKSUM_BYTES]


def _fingerprint(description: str) -> bytes:
    """SHA-256 of the description without its display texts (pattern spelling)."""
    doc = json.loads(description)
    for t in doc["triggers"]:
        del t["text"]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()).digest()


def _config(c: EngineConfig) -> dict[str, Any]:
    return {
        "event_types": list(c.event_types),
        "key_fields": list(c.key_fields),
        "value_fields": list(c.value_fields),
        "lateness_ms": c.lateness_ms,
        "max_keys": c.max_keys,
        "key_ttl_ms": c.key_ttl_ms,
    }


def _trigger(c: EngineConfig, t: TriggerSpec, removed: bool) -> dict[str, Any]:
    steps = []
    for j, s in enumerate(t.steps):
        conds = sorted(
            [
                c.value_fields[x.field] if x.on_value else c.key_fields[x.field],
                CMP_OPS[x.cmp],
                float(x.literal).hex() if x.on_value else int(x.literal),
            ]
            for x in s.conditions
        )
        op = "" if j == 0 else ("~>" if s.op == GAP else "->")
        steps.append([op, c.event_types[s.type], conds])
    features = [
        [
            AGGREGATIONS[f.agg],
            None if f.field < 0 else c.value_fields[f.field],
            ("sliding", "tumbling", "count")[f.window_kind],
            f.window_size,
            None if f.of < 0 else c.event_types[f.of],
            [e.hex() for e in f.edges],
        ]
        for f in t.features
    ]
    return {
        "id": t.id,
        "steps": steps,
        "by": c.key_fields[t.by],
        "within_ms": t.within_ms,
        "features": features,
        "removed": removed,
        "text": f"{t.pattern!r} by {c.key_fields[t.by]}"
        + ("" if t.within_ms < 0 else f" within {t.within_ms} ms")
        + f" features [{', '.join(f.name for f in t.features)}]"
        + (" (removed)" if removed else ""),
    }


def _difference(theirs: str, ours: str) -> str:
    """Say what differs between a snapshot's description and the engine's."""
    try:
        return _compare(json.loads(theirs), json.loads(ours))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "snapshot is of a different engine (its description is unreadable)"


def _compare(snap: dict[str, Any], mine: dict[str, Any]) -> str:
    problems = [
        f"config {name}: snapshot {snap['config'].get(name)!r}, engine {value!r}"
        for name, value in mine["config"].items()
        if snap["config"].get(name) != value
    ]
    their_triggers, my_triggers = snap["triggers"], mine["triggers"]
    for a, b in zip(their_triggers, my_triggers, strict=False):
        if {**a, "text": ""} != {**b, "text": ""}:
            problems.append(f"trigger {b['id']}: snapshot {a['text']}, engine {b['text']}")
    for a in their_triggers[len(my_triggers) :]:
        problems.append(f"trigger {a['id']} only in the snapshot: {a['text']}")
    for b in my_triggers[len(their_triggers) :]:
        problems.append(f"trigger {b['id']} only in the engine: {b['text']}")
    detail = "; ".join(problems) or "descriptions differ"
    return f"snapshot is of a different engine or trigger set: {detail}"
