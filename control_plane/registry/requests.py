"""What a push or a lookup names, checked before anything is read or run.

Model names, version numbers, variant lists and ``NAME[:VERSION]`` references arrive from
clients, rollouts and devices; each is validated here once, with an error that names the
rule it broke.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from contract import errors
from contract.limits import (  # noqa: F401 - re-exported: the names' old home
    MAX_NOTES,
    MAX_VERSION,
    MODEL_NAME,
    VARIANT_NAME,
    check_text,
)
from control_plane.registry import upload_spool
from control_plane.registry.contract import DERIVED_VARIANTS, LLM_VARIANTS, unknown_variants
from control_plane.registry.golden_request import GoldenRequest

if TYPE_CHECKING:
    from runtime.pipeline_spec import PipelineSpec


@dataclass(frozen=True)
class PushRequest:
    """What a caller asks for when pushing a model."""

    name: str
    actor: str
    notes: str = ""
    variants: tuple[str, ...] = ()
    filename: str = ""
    # What the client says it sent (0 / "" = not declared); checked after the upload.
    size: int = 0
    sha256: str = ""
    golden: GoldenRequest = GoldenRequest()
    # The version's event pipeline, checked on its own; fitted to the model at push.
    pipeline: PipelineSpec | None = None
    # Store it even when its bytes are those of the model's latest version.
    allow_duplicate: bool = False


def parse_pipeline(text: str) -> PipelineSpec | None:
    """Check a pushed pipeline spec (JSON text, "" = none) on its own."""
    from runtime.pipeline_spec import PipelineError
    from runtime.pipeline_spec import parse_pipeline as parse

    if not text:
        return None
    try:
        return parse(text)
    except PipelineError as exc:
        raise errors.InvalidArgument(f"pipeline: {exc}") from None


def check_request(request: PushRequest) -> tuple[str, ...]:
    """Validate everything a push names before any byte is read; return the extra variants."""
    validate_name(request.name)
    check_text("notes", request.notes, MAX_NOTES, multiline=True)
    if request.size < 0:
        raise errors.InvalidArgument(f"declared size {request.size} is negative")
    request.golden.check()
    return _validate_variants(request.variants)


def check_upload(request: PushRequest, upload: upload_spool.Spooled) -> None:
    """Check a spooled upload against what its request declared."""
    if upload.size == 0:
        raise errors.InvalidArgument("model file is empty")
    if request.size and upload.size != request.size:
        raise errors.InvalidArgument(
            f"upload has {upload.size} bytes, header declared {request.size}"
        )
    if request.sha256 and upload.sha256 != request.sha256.lower():
        raise errors.IntegrityError("upload does not match the SHA-256 the client declared")


def validate_name(name: str) -> str:
    """Return a valid model name or raise InvalidArgument naming the rule."""
    if not MODEL_NAME.fullmatch(name or ""):
        raise errors.InvalidArgument(
            f"invalid model name {name!r:.80}: use 1-64 of lowercase letters, digits, '-', '_'"
        )
    return name


def validate_version(number: int | None) -> int | None:
    """Return a version number (None = latest) if it is 1 to MAX_VERSION (an int32 column)."""
    if number is not None and not 1 <= number <= MAX_VERSION:
        raise errors.InvalidArgument(f"invalid version {number}: use 1 to {MAX_VERSION}")
    return number


def validate_positive_version(number: object) -> int:
    """Return `number` if it is an int from 1 to MAX_VERSION (a page token's key)."""
    if isinstance(number, bool) or not isinstance(number, int):
        raise errors.InvalidArgument(f"invalid version {number!r:.20}")
    validate_version(number)
    return number


def parse_ref(ref: str) -> tuple[str, int | None]:
    """Split NAME[:VERSION] into its parts; InvalidArgument when malformed."""
    name, sep, version = ref.partition(":")
    validate_name(name)
    if not sep:
        return name, None
    # ASCII digits only: str.isdigit() also accepts '²', which int() then refuses.
    if not (version.isascii() and version.isdecimal()) or not 1 <= int(version) <= MAX_VERSION:
        raise errors.InvalidArgument(
            f"invalid version {version!r:.20} in {ref!r:.100}: use 1 to {MAX_VERSION}"
        )
    return name, int(version)


def _validate_variants(variants: Iterable[str]) -> tuple[str, ...]:
    chosen = tuple(dict.fromkeys(variants))
    unknown = [v for v in chosen if v not in (*DERIVED_VARIANTS, *LLM_VARIANTS)]
    if unknown:
        raise errors.InvalidArgument(unknown_variants(unknown))
    return chosen
