"""Whether a push would remake a model's latest version, and how its refusal reads.

A duplicate is the latest version's source bytes (their SHA-256) again, with the same
variants, and no pipeline on either: re-running a push script must not make a version
nobody asked for. Other variants or a pipeline make a new version; `--allow-duplicate`
makes one anyway (with other golden data or notes, say).
"""

from __future__ import annotations

import json

from contract import errors
from control_plane.registry.contract import BASE_VARIANT, LLM_DEFAULT_VARIANTS, LLM_FORMATS
from control_plane.registry.requests import PushRequest
from control_plane.store.base import VersionRecord

__all__ = ["refuse_duplicate"]


def refuse_duplicate(latest: VersionRecord, request: PushRequest, sha256: str) -> None:
    """Raise FailedPrecondition naming `latest` if the push would remake it."""
    if request.allow_duplicate or not sha256:
        return
    manifest = _manifest(latest)
    # The same bytes are the same format: a language model keeps only the bundles asked
    # for (q4 when none is), any other model fp32 and its derived variants.
    if latest.source_format in LLM_FORMATS:
        asked = set(request.variants or LLM_DEFAULT_VARIANTS)
    else:
        asked = {BASE_VARIANT, *request.variants}
    same = (
        source_sha256(latest, manifest) == sha256.lower()
        and {v.name for v in latest.variants} == asked
        and request.pipeline is None
        and not manifest.get("pipeline")
    )
    if not same:
        return
    what = f"{request.filename!r:.80}" if request.filename else "this upload"
    raise errors.FailedPrecondition(
        f"{what} has the same bytes and variants as {latest.model}:{latest.number}, the "
        f"latest version (sha256 {sha256.lower()[:12]}...): nothing stored; pass "
        "--allow-duplicate to push it again as a new version (with other golden data, say)"
    )


def source_sha256(record: VersionRecord, manifest: dict) -> str:
    """Return the SHA-256 of the file a version was pushed from ("" if it does not say).

    Versions from before the manifest recorded it still say for a pushed .mnn: it is
    stored as is, as their fp32 variant.
    """
    found = manifest.get("source_sha256")
    if isinstance(found, str) and found:
        return found
    fp32 = record.variant(BASE_VARIANT)
    return fp32.plaintext_sha256 if record.source_format == "mnn" and fp32 else ""


def _manifest(record: VersionRecord) -> dict:
    try:
        manifest = json.loads(record.manifest) if record.manifest else {}
    except ValueError:
        return {}
    return manifest if isinstance(manifest, dict) else {}
