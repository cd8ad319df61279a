"""What the CLI checks before it trusts a version: the signed manifest, not the server.

A version's manifest must verify under a key the CLI pinned (valid now), name the model
and version asked for, and describe the variant whose bytes are written; the sizes and
digests a pull checks come from that signed manifest, never from unsigned fields.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from contract import errors
from contract.assignment import AssignmentRejected
from contract.pinned_keys import PinnedKeyRing
from control_plane.registry.contract import BASE_VARIANT, MANIFEST_SCHEMA
from protos import common_pb2


@dataclass(frozen=True)
class VerifiedManifest:
    """A manifest that verified under a pinned key, and that key's id."""

    key_id: str
    body: dict


def verify_version(
    pins: PinnedKeyRing,
    version: common_pb2.ModelVersion,
    *,
    model: str,
    number: int | None,
    now: dt.datetime | None = None,
) -> VerifiedManifest:
    """Check `version`'s manifest against the pins and the request; IntegrityError if not.

    `number` None accepts whichever version the server answered (the latest), but the
    manifest must still name that version.
    """
    now = now or dt.datetime.now(dt.UTC)
    what = f"{model}:{number or version.version}"
    try:
        key_id, manifest = pins.verify(version.manifest, version.manifest_signature, now)
    except AssignmentRejected as exc:
        raise errors.IntegrityError(f"manifest of {what}: {exc}") from None
    wanted = {
        "schema": MANIFEST_SCHEMA,
        "model": model,
        "version": number if number is not None else version.version,
    }
    for field, value in wanted.items():
        if manifest.get(field) != value:
            raise errors.IntegrityError(
                f"signed manifest of {what} names {field} {manifest.get(field)!r}, not {value!r}"
            )
    if version.model != model or version.version != wanted["version"]:
        raise errors.IntegrityError(f"server answered {version.model}:{version.version} for {what}")
    return VerifiedManifest(key_id, manifest)


def signed_golden(verified: VerifiedManifest) -> tuple[int, str]:
    """Return (plaintext size, SHA-256) of the version's golden data, from its manifest."""
    entry = verified.body.get("golden")
    if not isinstance(entry, dict) or not entry:
        raise errors.NotFound("this version has no golden data (pushed before golden data)")
    size, digest = entry.get("plaintext_size"), entry.get("plaintext_sha256")
    if not isinstance(size, int) or not isinstance(digest, str):
        raise errors.IntegrityError("signed manifest lacks the digest of the golden data")
    return size, digest


def signed_variant(verified: VerifiedManifest, asked: str, got: str) -> tuple[int, str]:
    """Return (plaintext size, SHA-256) of the variant pulled, from the signed manifest."""
    if got != (asked or BASE_VARIANT):
        raise errors.IntegrityError(f"server sent variant {got!r} for {asked or BASE_VARIANT!r}")
    entry = verified.body.get("variants", {}).get(got)
    if not isinstance(entry, dict):
        raise errors.IntegrityError(f"signed manifest has no variant {got!r}")
    size, digest = entry.get("plaintext_size"), entry.get("plaintext_sha256")
    if not isinstance(size, int) or not isinstance(digest, str):
        raise errors.IntegrityError(f"signed manifest lacks the digest of variant {got!r}")
    return size, digest
