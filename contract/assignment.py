"""Checks a Sync answer before a device acts on it (the device side of delivery).

The control plane signs one document per answer: the device id, the device's nonce, a
revision that only grows, the time it signed (`issued_at`), an expiry, and per model the
version, variant, version uid and digests. A device accepts an answer only if that
document verifies under a pinned key, names this device, echoes its nonce, is not older
than the last answer it accepted, has not expired, and agrees with every assignment it
carries, down to the manifest (itself signed) and the wrapped key. So a replayed, older,
expired, re-targeted or mixed-and-matched answer is refused.

Expiry is judged on the control plane's time, never on the device's clock (which may be
a day off): the echoed nonce proves the answer was signed after the request left, so at
most the round trip ago, and `issued_at` says when that was on the control plane's
clock (contract.server_clock measures the device's offset from the same reading).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from contract import errors
from contract.chunks import KEY_SIZE, ChunkTable
from contract.segments import decode_digests

ASSIGNMENT_SCHEMA = "skiff.assignment/v1"
NONCE_BYTES = 16

# The keys that may sign: Ed25519 (local key files) and ECDSA P-256 with SHA-256 (the
# asymmetric KMS key spec ECC_NIST_P256). Nothing else is accepted, so a verifier never
# meets a key type whose signature scheme it would have to guess.
PublicKey = Ed25519PublicKey | ec.EllipticCurvePublicKey


class AssignmentRejected(Exception):
    """The answer must not be acted on; the message says why."""


def canonical_json(body: dict[str, Any]) -> bytes:
    """Return the one byte form of a document that is signed and verified (both sides)."""
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode("ascii")


def load_public_key(pem: bytes) -> PublicKey:
    """Parse one signing public key (PEM): Ed25519 or ECDSA P-256, else AssignmentRejected."""
    try:
        key = serialization.load_pem_public_key(pem)
    except (ValueError, TypeError):
        raise AssignmentRejected("a signing key is not a PEM public key") from None
    if isinstance(key, Ed25519PublicKey):
        return key
    if isinstance(key, ec.EllipticCurvePublicKey) and isinstance(key.curve, ec.SECP256R1):
        return key
    raise AssignmentRejected("a signing key is neither Ed25519 nor ECDSA P-256")


def load_public_keys(pems: Sequence[bytes]) -> list[PublicKey]:
    """Parse pinned public keys (PEM), each Ed25519 or ECDSA P-256."""
    return [load_public_key(pem) for pem in pems]


def key_id_of(key: PublicKey) -> str:
    """Return a key's id: 16 hex digits of SHA-256 over its raw bytes (Ed25519) or DER.

    Computed by every verifier from the key itself, never taken from the network.
    """
    if isinstance(key, Ed25519PublicKey):
        raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    else:
        raw = key.public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    return hashlib.sha256(raw).hexdigest()[:16]


def signature_valid(key: PublicKey, signature: bytes, body: bytes) -> bool:
    """Return whether `signature` over `body` verifies under `key` (Ed25519 or ECDSA)."""
    try:
        if isinstance(key, Ed25519PublicKey):
            key.verify(signature, body)
        else:
            key.verify(signature, body, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature:
        return False
    return True


def verify_signed(body: bytes, signature: bytes, keys: Sequence[PublicKey]) -> dict:
    """Return the parsed document if one pinned key signed exactly these canonical bytes."""
    if not any(signature_valid(key, signature, body) for key in keys):
        raise AssignmentRejected("signature does not verify under any pinned key")
    try:
        doc = json.loads(body)
    except ValueError:
        raise AssignmentRejected("signed document is not JSON") from None
    if not isinstance(doc, dict) or canonical_json(doc) != body:
        raise AssignmentRejected("signed document is not canonical JSON")
    return doc


@dataclass(frozen=True)
class VerifiedModel:
    """One model of an accepted answer: what to fetch, how to check it, its wrapped key."""

    model: str
    version: int
    variant: str
    rollout: str
    uid: str
    ciphertext_sha256: str
    ciphertext_size: int
    plaintext_sha256: str
    plaintext_size: int
    associated_data: bytes
    segment_size: int
    url: str
    wrapped_data_key: bytes
    # The version's golden data (inputs and fp32 reference outputs, same data key), checked
    # against the signed manifest; None for versions without it.
    golden: GoldenArtifact | None = None
    # Below the publisher's accuracy bar, served because the rollout named it.
    degraded: bool = False
    # The version's event pipeline spec (runtime.pipeline), as the manifest signs it.
    pipeline: dict | None = None
    # The ciphertext's per-segment SHA-256 digests, concatenated (control_plane.crypto.
    # segments); b"" for versions pushed before the manifest carried them.
    segment_sha256: bytes = b""
    # The backend config the fleet found fastest on this device's class (advisory: not
    # signed; tried first, and served only if it passes the golden check here).
    recommended_config: str = ""
    # A language model's description (architecture, vocabulary, context, chat template)
    # as the manifest signs it: the artifact is an MNN-LLM bundle (a tar). None otherwise.
    llm: dict | None = None
    # What the variant needs of a device (memory_mb, disk_mb, mnn), as signed; {} if unsaid.
    requirements: dict = field(default_factory=dict)
    # The variant as content-defined chunks (contract.chunks), as the manifest signs it,
    # and where its chunk keys are (encrypted under the data key); None for versions
    # pushed before chunks, which install as one artifact.
    chunks: ChunkTable | None = None
    chunk_keys: GoldenArtifact | None = None


@dataclass(frozen=True)
class GoldenArtifact:
    """Where a version's golden data is and what it decrypts to."""

    ciphertext_sha256: str
    ciphertext_size: int
    plaintext_sha256: str
    plaintext_size: int
    segment_size: int
    associated_data: bytes


@dataclass(frozen=True)
class VerifiedAssignment:
    """An accepted Sync answer."""

    device_id: str
    revision: int
    expires_at: dt.datetime
    models: dict[str, VerifiedModel]
    # The control plane's time as it signed the answer (None from a server that omits it).
    issued_at: dt.datetime | None = None


def new_nonce() -> bytes:
    """Return fresh random bytes for one Sync: its signed answer must echo them."""
    return os.urandom(NONCE_BYTES)


def verify_sync(
    response,
    *,
    device_id: str,
    nonce: bytes,
    keys: Sequence[PublicKey],
    last_revision: int,
    now: dt.datetime | None = None,
    round_trip_s: float = 0.0,
) -> VerifiedAssignment:
    """Check a SyncResponse end to end; AssignmentRejected names the first problem.

    `nonce` is what the device sent with this Sync: an answer recorded earlier (even at
    the same revision, for the same device) does not carry it and is refused. Expiry is
    judged at `now` when the caller gives the control plane's time; without it, on the
    answer's own signed `issued_at` plus `round_trip_s` (the longest the answer can have
    been on its way, since it echoes the nonce), so a device clock that is off plays no
    part and the allowance for the trip is bounded by the trip itself.
    """
    doc = verify_signed(response.document, response.document_signature, keys)
    if doc.get("schema") != ASSIGNMENT_SCHEMA:
        raise AssignmentRejected(f"unknown assignment schema {doc.get('schema')!r}")
    if doc.get("device") != device_id:
        raise AssignmentRejected("assignment is for another device")
    if len(nonce) < NONCE_BYTES or doc.get("nonce") != nonce.hex():
        raise AssignmentRejected("assignment does not answer this request (nonce differs)")
    revision = doc.get("revision")
    if not isinstance(revision, int) or revision < last_revision:
        raise AssignmentRejected(f"assignment revision {revision} is older than {last_revision}")
    if revision != response.revision:
        raise AssignmentRejected("response revision differs from the signed one")
    expires = _signed_time(doc, "expires_at", "expiry")
    issued = _signed_time(doc, "issued_at", "issue time") if "issued_at" in doc else None
    if now is None:
        if issued is None:
            raise AssignmentRejected("assignment has no valid issue time")
        now = issued + dt.timedelta(seconds=max(0.0, round_trip_s))
        judged = f"control plane time {now.isoformat(timespec='seconds')}, signed within the trip"
    else:
        judged = f"judged at {now.isoformat(timespec='seconds')}"
    if expires <= now:
        raise AssignmentRejected(f"assignment expired at {doc['expires_at']} ({judged})")
    entries = doc.get("models", {})
    if sorted(entries) != sorted(m.model for m in response.models):
        raise AssignmentRejected("assignments differ from the signed list of models")
    models = {m.model: _verified_model(m, entries[m.model], keys) for m in response.models}
    return VerifiedAssignment(device_id, revision, expires, models, issued)


def _signed_time(doc: dict, key: str, what: str) -> dt.datetime:
    try:
        value = dt.datetime.fromisoformat(doc[key])
    except (KeyError, TypeError, ValueError):
        raise AssignmentRejected(f"assignment has no valid {what}") from None
    if value.tzinfo is None:
        raise AssignmentRejected(f"assignment has no valid {what} (no time zone)")
    return value


MAX_CONFIG_KEY = 128


def _verified_model(m, entry: dict, keys: Sequence[PublicKey]) -> VerifiedModel:
    a = m.artifact
    carried = {
        "version": m.version,
        "variant": m.variant,
        "rollout": m.rollout,
        "ciphertext_sha256": a.ciphertext_sha256,
        "ciphertext_size": a.ciphertext_size,
        "segment_size": a.segment_size,
        "plaintext_sha256": a.plaintext_sha256,
        "plaintext_size": a.plaintext_size,
        "associated_data": a.associated_data,
        "manifest_sha256": hashlib.sha256(m.manifest).hexdigest(),
        "wrapped_key_sha256": hashlib.sha256(m.wrapped_data_key).hexdigest()
        if m.wrapped_data_key
        else "",
    }
    carried["golden_sha256"] = m.golden.ciphertext_sha256 if m.HasField("golden") else ""
    for key, value in carried.items():
        if entry.get(key, "" if key == "golden_sha256" else None) != value:
            raise AssignmentRejected(f"{m.model}: {key} differs from the signed assignment")
    manifest = verify_signed(m.manifest, m.manifest_signature, keys)
    variant = manifest.get("variants", {}).get(m.variant, {})
    if (
        manifest.get("model") != m.model
        or manifest.get("version") != m.version
        or manifest.get("uid") != entry.get("uid")
        or variant.get("ciphertext_sha256") != a.ciphertext_sha256
        or variant.get("plaintext_sha256") != a.plaintext_sha256
    ):
        raise AssignmentRejected(f"{m.model}: manifest does not match the assignment")
    golden = _verified_golden(m, manifest.get("golden") or {})
    return VerifiedModel(
        model=m.model,
        version=m.version,
        variant=m.variant,
        rollout=m.rollout,
        uid=entry["uid"],
        ciphertext_sha256=a.ciphertext_sha256,
        ciphertext_size=a.ciphertext_size,
        plaintext_sha256=a.plaintext_sha256,
        plaintext_size=a.plaintext_size,
        associated_data=a.associated_data.encode(),
        segment_size=a.segment_size,
        url=a.url,
        wrapped_data_key=m.wrapped_data_key,
        golden=golden,
        degraded=bool(variant.get("degraded", False)),
        pipeline=_pipeline(m.model, manifest.get("pipeline")),
        segment_sha256=_segments(m.model, variant, a.ciphertext_size),
        recommended_config=m.recommended_config[:MAX_CONFIG_KEY],
        llm=_signed_dict(m.model, "llm", manifest.get("llm")),
        requirements=_signed_dict(m.model, "requirements", variant.get("requirements")) or {},
        **_chunked(m.model, variant.get("chunks"), a.plaintext_size),
    )


def _chunked(model: str, signed, plaintext_size: int) -> dict:
    """Return the chunk table and key list a manifest signs for a variant ({} if none)."""
    if signed is None:
        return {}
    try:
        if not isinstance(signed, dict) or not isinstance(signed.get("keys"), dict):
            raise errors.IntegrityError("the chunk record is not an object")
        table = ChunkTable.from_manifest(signed.get("table"), plaintext_size)
        k = signed["keys"]
        keys = GoldenArtifact(
            ciphertext_sha256=str(k["ciphertext_sha256"]),
            ciphertext_size=int(k["ciphertext_size"]),
            plaintext_sha256=str(k["plaintext_sha256"]),
            plaintext_size=int(k["plaintext_size"]),
            segment_size=int(k["segment_size"]),
            associated_data=str(k["associated_data"]).encode(),
        )
    except (errors.IntegrityError, KeyError, TypeError, ValueError) as exc:
        raise AssignmentRejected(f"{model}: manifest chunks: {exc}") from None
    if keys.plaintext_size != KEY_SIZE * len(table.chunks):
        raise AssignmentRejected(f"{model}: manifest chunks: the key list does not fit the table")
    return {"chunks": table, "chunk_keys": keys}


def _signed_dict(model: str, key: str, value) -> dict | None:
    """Return a signed manifest entry that must be an object (None when absent)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise AssignmentRejected(f"{model}: manifest {key} is not an object")
    return value


def _segments(model: str, variant: dict, size: int) -> bytes:
    # Deferred: control_plane.crypto's package imports this module (signing).

    if "segment_sha256" not in variant:
        return b""
    try:
        return decode_digests(variant["segment_sha256"], size)
    except errors.IntegrityError as exc:
        raise AssignmentRejected(f"{model}: manifest {exc}") from None


def _pipeline(model: str, signed) -> dict | None:
    if signed is not None and not isinstance(signed, dict):
        raise AssignmentRejected(f"{model}: the manifest's pipeline is not an object")
    return signed


def _verified_golden(m, signed: dict) -> GoldenArtifact | None:
    """Return the golden data descriptor if it matches what the manifest signs."""
    if not m.HasField("golden"):
        if signed:
            raise AssignmentRejected(f"{m.model}: golden data signed but not offered")
        return None
    g = m.golden
    found = GoldenArtifact(
        ciphertext_sha256=g.ciphertext_sha256,
        ciphertext_size=g.ciphertext_size,
        plaintext_sha256=g.plaintext_sha256,
        plaintext_size=g.plaintext_size,
        segment_size=g.segment_size,
        associated_data=g.associated_data.encode(),
    )
    for key in ("ciphertext_sha256", "ciphertext_size", "plaintext_sha256", "plaintext_size"):
        if signed.get(key) != getattr(found, key):
            raise AssignmentRejected(f"{m.model}: golden {key} differs from the signed manifest")
    if signed.get("associated_data") != g.associated_data:
        raise AssignmentRejected(f"{m.model}: golden associated_data differs from the manifest")
    return found
