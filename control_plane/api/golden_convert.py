"""Golden data and variant accuracy: between registry records and protobuf messages."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from contract import errors
from contract.limits import check_text
from control_plane.registry.contract import DEFAULT_MIN_COSINE
from control_plane.registry.golden_request import MAX_HINTS, GoldenRequest
from protos import admin_pb2, common_pb2

__all__ = ["accuracy_pb", "golden_pb", "golden_request"]

_MAX_INPUT_NAME = 256
_MAX_RANK = 16


def accuracy_pb(figures: dict[str, Any]) -> common_pb2.VariantAccuracy | None:
    """Return a variant's accuracy message, or None when it has none (fp32, old versions).

    Stored figures use null for an output that was missing or not finite: sent as inf.
    """
    if not figures:
        return None
    return common_pb2.VariantAccuracy(
        cosine=_number(figures.get("cosine"), 0.0),
        max_abs_error=_number(figures.get("max_abs_error"), float("inf")),
        min_cosine=_number(figures.get("min_cosine"), 0.0),
        relative_error=_number(figures.get("relative_error"), float("inf")),
        outputs=[
            common_pb2.OutputAccuracy(
                name=o["name"],
                cosine=_number(o.get("cosine"), 0.0),
                max_abs_error=_number(o.get("max_abs_error"), float("inf")),
                relative_error=_number(o.get("relative_error"), float("inf")),
            )
            for o in figures.get("outputs", [])
        ],
        top1_agreement=_number(figures.get("top1_agreement"), 0.0),
        mean_kl=_number(figures.get("mean_kl"), float("inf")) if "mean_kl" in figures else 0.0,
        min_top1=_number(figures.get("min_top1"), 0.0),
        positions=int(figures.get("positions", 0)),
    )


def golden_pb(blob: dict[str, Any]) -> common_pb2.GoldenData | None:
    """Return a version's golden data message, or None for versions without golden data."""
    if not blob:
        return None
    return common_pb2.GoldenData(
        ciphertext_sha256=blob["ciphertext_sha256"],
        ciphertext_size=blob["ciphertext_size"],
        plaintext_sha256=blob["plaintext_sha256"],
        plaintext_size=blob["plaintext_size"],
        segment_size=blob["segment_size"],
        source=blob.get("source", ""),
    )


def golden_request(header: admin_pb2.PushHeader, golden: bytes) -> GoldenRequest:
    """Build the golden part of a push from its header; InvalidArgument names a bad hint."""
    if len(header.input_shapes) + len(header.input_ranges) > MAX_HINTS:
        raise errors.InvalidArgument(f"more than {MAX_HINTS} input shapes and ranges")
    shapes = _unique(
        "--input-shape", ((s.name, _shape(s.name, s.shape)) for s in header.input_shapes)
    )
    ranges = _unique("--input-range", ((r.name, (r.low, r.high)) for r in header.input_ranges))
    request = GoldenRequest(
        golden=golden,
        input_shapes=shapes,
        input_ranges=ranges,
        min_cosine=header.min_cosine or DEFAULT_MIN_COSINE,
        allow_degraded=header.allow_degraded,
    )
    request.check()
    return request


def _shape(name: str, dims: Iterable[int]) -> tuple[int, ...]:
    shape = tuple(dims)
    if len(shape) > _MAX_RANK:
        raise errors.InvalidArgument(f"input shape for {name!r:.64} has more than {_MAX_RANK} dims")
    return shape


def _unique(flag: str, items: Iterable[tuple[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, value in items:
        check_text(f"{flag} input name", name, _MAX_INPUT_NAME)
        if not name:
            raise errors.InvalidArgument(f"{flag} needs an input name")
        if name in found:
            raise errors.InvalidArgument(f"{flag} names input {name!r:.64} twice")
        found[name] = value
    return found


def _number(value: Any, missing: float) -> float:
    return missing if value is None else float(value)
