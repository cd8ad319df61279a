"""Names and defaults of the registry that the server, the CLI and the API share.

Nothing heavy is imported here, so a client (`skiff --help`, a script) does not load
numpy and the MNN tooling just to know them.
"""

from __future__ import annotations

from collections.abc import Mapping

# Every version has this variant: the model as published (converted to MNN), in fp32.
BASE_VARIANT = "fp32"
# The variants a push may derive from it (`--variant`), weight-quantised or half precision.
DERIVED_VARIANTS = ("fp16", "int8", "int4")
# A language model (a GGUF push) is stored only as the bundles it asks for, each weight-quantised
# block-wise (q4: int4, q8: int8) or in half precision; q4 when none is named. Its reference is
# an fp32 forward pass of the GGUF's own weights, kept nowhere but in the push's numbers.
LLM_VARIANTS = ("q4", "q8", "fp16")
LLM_DEFAULT_VARIANTS = ("q4",)
# Source formats of language models: a GGUF (converted) and an MNN-LLM bundle (as is).
LLM_FORMATS = {"gguf": "a GGUF language model", "mnn-llm": "an MNN-LLM bundle"}
# The manifest format a version's signature covers (control_plane.registry.registry).
MANIFEST_SCHEMA = "skiff.manifest/v1"
# A derived variant's outputs must reach this cosine similarity with fp32's unless the
# publisher sets another floor (`--min-cosine`).
DEFAULT_MIN_COSINE = 0.99
# A push's golden data (.npz), compressed; golden inputs are a handful of samples.
MAX_GOLDEN_UPLOAD = 64 << 20


def unknown_variants(unknown: list[str]) -> str:
    """Say which names are not variants a push can derive, and which are (CLI and server)."""
    allowed = ", ".join(DERIVED_VARIANTS)
    llm = ", ".join(LLM_VARIANTS)
    if BASE_VARIANT in unknown:
        return f"{BASE_VARIANT} is always kept (the model as pushed): --variant derives {allowed}"
    names = ", ".join(repr(v)[:40] for v in unknown)
    return (
        f"unknown variant {names}: --variant derives {allowed} (a comma list: int8,fp16); "
        f"for a GGUF language model {llm}"
    )


def misplaced_variants(fmt: str, variants: tuple[str, ...]) -> str | None:
    """Say why variants do not fit a source format (MNN variants for a GGUF, or the reverse)."""
    if fmt in LLM_FORMATS:
        wrong = [v for v in variants if v not in LLM_VARIANTS]
        kind, allowed = LLM_FORMATS[fmt], LLM_VARIANTS
    else:
        wrong = [v for v in variants if v not in DERIVED_VARIANTS]
        kind, allowed = f"an {fmt.upper()} model", DERIVED_VARIANTS
    if not wrong:
        return None
    return f"variant {', '.join(wrong)} does not apply to {kind}: it derives {', '.join(allowed)}"


def default_variant(variants: list[str]) -> str:
    """Return the variant a rollout ships when it names none.

    fp32 (every tensor model's base) if the version has it, else its first (a language
    model's first bundle).
    """
    return BASE_VARIANT if BASE_VARIANT in variants else variants[0]


def variant_needs(manifest: Mapping, variant: str) -> dict:
    """Return what a variant needs of a device, as a version's manifest says ({}: nothing)."""
    entry = (manifest.get("variants") or {}).get(variant)
    needs = entry.get("requirements") if isinstance(entry, Mapping) else None
    return dict(needs) if isinstance(needs, Mapping) else {}
