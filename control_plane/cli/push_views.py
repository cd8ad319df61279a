"""What `skiff model push` says it did: the version it made, then one line per variant.

A variant that misses an accuracy bar without `--allow-degraded` refuses the whole push:
nothing is stored and the error line says each variant's verdict (the registry's
`golden.refuse_degraded`). So a push that returns has kept every variant: passed, or
kept marked degraded, with the bar it failed. `--json` prints the version
(`views.version_dict`), each variant with its `status` and `failed_bars`.
"""

from __future__ import annotations

from control_plane.registry import accuracy_bars
from protos import common_pb2

__all__ = ["push_text", "variant_summary"]


def push_text(version: common_pb2.ModelVersion) -> str:
    """Return the push's lines: "pushed NAME:VERSION", then one per variant."""
    lines = [f"pushed {version.model}:{version.version}"]
    lines += [f"  {variant_summary(v)}" for v in version.variants]
    return "\n".join(lines)


def variant_summary(variant: common_pb2.Variant) -> str:
    """Say what became of one variant, as in "int8 kept: cosine 0.9998 >= 0.99, ..."."""
    if not variant.HasField("accuracy"):
        return f"{variant.name} kept (the reference: the model as pushed)"
    why = accuracy_bars.reason(variant.accuracy)
    if not variant.degraded:
        return f"{variant.name} kept: {why}"
    return (
        f"{variant.name} degraded: {why}; stored because of --allow-degraded (a rollout "
        "takes it only with --allow-degraded)"
    )
