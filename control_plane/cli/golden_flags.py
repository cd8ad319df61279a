"""`skiff model push` flags: variants, duplicates, golden inputs and the accuracy bar."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from contract.command_line import UsageError
from control_plane.registry.contract import (
    BASE_VARIANT,
    DEFAULT_MIN_COSINE,
    DERIVED_VARIANTS,
    LLM_VARIANTS,
    unknown_variants,
)

__all__ = ["add_golden_flags", "add_push_flags", "golden_options", "push_options"]


def add_push_flags(p: argparse.ArgumentParser) -> None:
    """Add --variant and --allow-duplicate.

    --variant takes one value per flag (a comma list), never a variable number of words:
    `--variant int8 model.onnx` must not read the model's file name as a variant.
    """
    p.add_argument(
        "--variant",
        action="extend",
        type=variant_list,
        default=[],
        metavar="V[,V...]",
        help=f"variants to derive beside {BASE_VARIANT}, a comma list "
        f"({', '.join(DERIVED_VARIANTS)}), as in --variant int8,fp16 (repeatable); for a "
        f"GGUF language model the bundles to build ({', '.join(LLM_VARIANTS)}; default q4)",
    )
    p.add_argument(
        "--allow-duplicate",
        action="store_true",
        help="push a file whose bytes are the model's latest version's again, as a new "
        "version (refused without it)",
    )


def push_options(args: argparse.Namespace) -> dict:
    """Return the keyword arguments AdminClient.push takes for every push flag but the file."""
    return {
        "variants": tuple(dict.fromkeys(args.variant)),
        "allow_duplicate": args.allow_duplicate,
        **golden_options(args),
    }


def variant_list(text: str) -> list[str]:
    """Parse a comma list of derived variants ("int8,fp16")."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma list of variants, as in int8,fp16")
    unknown = [name for name in names if name not in (*DERIVED_VARIANTS, *LLM_VARIANTS)]
    if unknown:
        raise argparse.ArgumentTypeError(unknown_variants(unknown))
    return names


def add_golden_flags(p: argparse.ArgumentParser) -> None:
    """Add --golden, --input-shape, --input-range, --min-cosine and --allow-degraded."""
    p.add_argument(
        "--golden",
        type=Path,
        metavar="INPUTS.npz",
        help="golden inputs: an .npz of arrays named after the model's inputs "
        "(default: seeded random inputs built from the signature)",
    )
    p.add_argument(
        "--golden-prompts",
        type=Path,
        metavar="PROMPTS.jsonl",
        help='a GGUF language model\'s golden prompts: {"prompt": TEXT} per line (default: a '
        "few short factual prompts); each variant is scored on the reference's answers",
    )
    p.add_argument(
        "--input-shape",
        action="append",
        type=input_shape,
        default=[],
        metavar="NAME=D1,D2,...",
        help="shape of an input with dynamic dimensions, for seeded golden inputs (repeatable)",
    )
    p.add_argument(
        "--input-range",
        action="append",
        type=input_range,
        default=[],
        metavar="NAME=LOW:HIGH",
        help="inclusive range of an input's seeded values; integer inputs need one (repeatable)",
    )
    p.add_argument(
        "--min-cosine",
        type=min_cosine,
        default=DEFAULT_MIN_COSINE,
        help=f"cosine similarity with fp32 each derived variant must reach on every output "
        f"(default {DEFAULT_MIN_COSINE})",
    )
    p.add_argument(
        "--allow-degraded",
        action="store_true",
        help="keep variants that miss the accuracy bars (--min-cosine, or the relative error "
        "it allows) marked degraded, instead of refusing the push",
    )


def golden_options(args: argparse.Namespace) -> dict:
    """Return the keyword arguments AdminClient.push takes for these flags."""
    if args.golden and args.golden_prompts:
        raise UsageError("--golden is for tensor models, --golden-prompts for GGUF: not both")
    return {
        "golden": args.golden or args.golden_prompts,
        "input_shapes": dict(args.input_shape),
        "input_ranges": dict(args.input_range),
        "min_cosine": args.min_cosine,
        "allow_degraded": args.allow_degraded,
    }


def input_shape(text: str) -> tuple[str, tuple[int, ...]]:
    """Parse NAME=D1,D2,... (positive integers)."""
    name, dims = _split(text, "NAME=D1,D2,...")
    try:
        shape = tuple(int(d) for d in dims.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: dimensions must be integers, as in x=1,3,48,192"
        ) from None
    if any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"{text!r}: dimensions must be positive")
    return name, shape


def input_range(text: str) -> tuple[str, tuple[float, float]]:
    """Parse NAME=LOW:HIGH (finite numbers, LOW <= HIGH)."""
    name, bounds = _split(text, "NAME=LOW:HIGH")
    try:
        low, high = (float(b) for b in bounds.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: use NAME=LOW:HIGH, as in sr=16000:16000"
        ) from None
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        raise argparse.ArgumentTypeError(f"{text!r}: need finite LOW <= HIGH")
    return name, (low, high)


def min_cosine(text: str) -> float:
    """Parse a cosine similarity bar in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: a cosine similarity in (0, 1], as in 0.99")
    return value


def _split(text: str, form: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name or not value:
        raise argparse.ArgumentTypeError(f"{text!r}: use {form}")
    return name, value
