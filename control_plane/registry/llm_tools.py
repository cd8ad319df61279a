"""Build a language model's bundles from a GGUF upload, out of process, and judge them.

The parent side of the worker's ``llm`` op (`control_plane.registry.llm.build`). One
confined MNN child reads the GGUF from its memfd, converts it into one MNN-LLM bundle per
variant (each a canonical tar written into its own memfd: nothing reaches a disk), runs an
independent fp32 numpy forward pass of the GGUF's weights as the reference, and scores
every variant against it, teacher-forced on the reference's greedy continuations of the
golden prompts. What comes back: the bundles, the figures, the golden generations (stored
encrypted with the version, for the device's self-test) and what each variant needs of a
device.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from contract import errors
from control_plane.registry.evaluation import Evaluation
from control_plane.registry.mnn_sandbox import Sandbox
from control_plane.registry.mnn_tools import run_worker
from control_plane.registry.requests import PushRequest

__all__ = [
    "DEFAULT_CHAT_PROMPTS",
    "DEFAULT_COMPLETION_PROMPTS",
    "LLM_MIN_TOP1",
    "LlmBuild",
    "build_from_gguf",
    "parse_golden_prompts",
]

# The bar a variant's teacher-forced top-1 agreement with the reference must reach. q4 of
# a 135M model flips close choices now and then (FACTS.md): 0.85 keeps those and refuses
# a broken conversion, which agrees at chance.
LLM_MIN_TOP1 = 0.85
# Tokens of greedy continuation the reference writes per prompt (and each variant is
# scored on).
GOLDEN_NEW_TOKENS = 24
# Golden prompts a publisher may send: a JSONL file of {"prompt": TEXT} lines.
MAX_PROMPTS = 16
MAX_PROMPT_CHARS = 2000
MAX_PROMPTS_BYTES = 64 << 10
# The default golden prompts: questions for a model with a chat template (asked through it),
# completions for a base model. Short, factual, answered the same way by any decent model,
# so the reference's continuation is confident and a variant's flips mean something.
DEFAULT_CHAT_PROMPTS = (
    "What is the capital of France?",
    "Name the three primary colours.",
    "What is two plus three?",
)
DEFAULT_COMPLETION_PROMPTS = (
    "The capital of France is",
    "Water is made of hydrogen and",
    "One, two, three, four,",
)
# Bounds on what the child may report back.
_MAX_RESULT_BYTES = 8 << 20


@dataclass
class LlmBuild:
    """A GGUF push's bundles (memfds, closed on exit) and what the child found."""

    fds: dict[str, int]
    evaluation: Evaluation
    llm: dict[str, Any]
    requirements: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __enter__(self) -> LlmBuild:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


def parse_golden_prompts(data: bytes) -> list[str] | None:
    """Return the prompts of a golden-prompts JSONL file (b"": None, the default prompts).

    InvalidArgument names the line: not UTF-8, not a JSON object with a "prompt" string,
    empty, too long, or too many prompts.
    """
    if not data:
        return None
    if len(data) > MAX_PROMPTS_BYTES:
        raise errors.InvalidArgument(
            f"golden prompts take {len(data):,} bytes (limit {MAX_PROMPTS_BYTES:,})"
        )
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is no prompt
    except UnicodeDecodeError as exc:
        raise errors.InvalidArgument(
            f"golden prompts are not UTF-8 (byte {exc.start}): a JSONL file of "
            '{"prompt": TEXT} lines'
        ) from None
    prompts: list[str] = []
    # JSONL lines end at "\n" only: a prompt may hold U+2028 and the like, unescaped.
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        prompt = item.get("prompt") if isinstance(item, dict) else None
        if not isinstance(prompt, str):
            raise errors.InvalidArgument(
                f'golden prompts line {number}: not a JSON object with a "prompt" string'
            )
        if not prompt.strip():
            raise errors.InvalidArgument(f"golden prompts line {number}: the prompt is empty")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise errors.InvalidArgument(
                f"golden prompts line {number}: {len(prompt):,} characters "
                f"(limit {MAX_PROMPT_CHARS:,})"
            )
        prompts.append(prompt)
        if len(prompts) > MAX_PROMPTS:
            raise errors.InvalidArgument(f"more than {MAX_PROMPTS} golden prompts")
    if not prompts:
        raise errors.InvalidArgument("golden prompts file holds no prompt")
    return prompts


def _refuse_other_flags(request: PushRequest, what: str) -> None:
    """Refuse what a push of a language model cannot use, naming the flag."""
    g = request.golden
    if g.input_shapes or g.input_ranges:
        raise errors.InvalidArgument(
            f"--input-shape and --input-range are for tensor models; {what} is checked on "
            "golden prompts (--golden-prompts)"
        )
    if request.pipeline is not None:
        raise errors.InvalidArgument(f"an event pipeline feeds tensor models, not {what}")


def build_from_gguf(
    src_fd: int,
    variants: Sequence[str],
    request: PushRequest,
    *,
    timeout: float,
    sandbox: Sandbox | None,
    block: int = 32,
) -> LlmBuild:
    """Convert and judge a GGUF upload in one confined child; return its bundles.

    A variant below LLM_MIN_TOP1 is refused with its figures (InvalidModel), unless the
    publisher allowed degraded variants: then it is kept and marked.
    """
    _refuse_other_flags(request, "a GGUF language model")
    return _build(src_fd, variants, request, "gguf", timeout, sandbox, block)


def build_from_bundle(
    src_fd: int,
    variants: Sequence[str],
    request: PushRequest,
    *,
    timeout: float,
    sandbox: Sandbox | None,
) -> LlmBuild:
    """Check and measure a published MNN-LLM bundle (a tar) in one confined child.

    The bundle is one variant, named by the push (`--variant`, q4 by default: what MNN's
    exporter writes unless told otherwise); it is its own reference.
    """
    _refuse_other_flags(request, "an MNN-LLM bundle")
    if len(variants) != 1:
        raise errors.InvalidArgument(
            f"an MNN-LLM bundle is one variant: name it with one --variant, not {len(variants)}"
        )
    return _build(src_fd, variants, request, "bundle", timeout, sandbox, 0)


def _build(
    src_fd: int,
    variants: Sequence[str],
    request: PushRequest,
    source: str,
    timeout: float,
    sandbox: Sandbox | None,
    block: int,
) -> LlmBuild:
    prompts = parse_golden_prompts(request.golden.golden)
    what = "GGUF" if source == "gguf" else "MNN-LLM bundle"
    recipe = {
        "source": source,
        "variants": list(variants),
        "block": block,
        "prompts": prompts,  # None: the child picks chat or completion defaults
        "default_prompts": {
            "chat": list(DEFAULT_CHAT_PROMPTS),
            "completion": list(DEFAULT_COMPLETION_PROMPTS),
        },
        "new_tokens": GOLDEN_NEW_TOKENS,
    }
    with contextlib.ExitStack() as stack:
        recipe_fd = os.memfd_create("skiff-llm-recipe", os.MFD_CLOEXEC)
        stack.callback(os.close, recipe_fd)
        os.pwrite(recipe_fd, json.dumps(recipe).encode(), 0)
        golden_fd = os.memfd_create("skiff-llm-golden", os.MFD_CLOEXEC)
        stack.callback(os.close, golden_fd)
        fds: dict[str, int] = {}
        built = LlmBuild(fds, Evaluation({}, {}, {}, b""), {})
        stack.push(built.__exit__)
        for name in variants:
            fds[name] = os.memfd_create(f"skiff-llm-{name}", os.MFD_CLOEXEC)
        argv = [
            "--src-fd",
            str(src_fd),
            "--recipe-fd",
            str(recipe_fd),
            "--outputs-fd",
            str(golden_fd),
            "--bundle-fds",
            ",".join(f"{name}={fd}" for name, fd in fds.items()),
        ]
        result = run_worker(
            "llm", argv, (src_fd, recipe_fd, golden_fd, *fds.values()), timeout, what, sandbox
        )
        golden = _read(golden_fd, what)
        built.evaluation, built.llm, built.requirements = _judged(
            result, variants, golden, request.golden.allow_degraded, what
        )
        stack.pop_all()
        return built


def _read(fd: int, what: str) -> bytes:
    size = os.fstat(fd).st_size
    if size > _MAX_RESULT_BYTES:
        raise errors.InvalidModel(f"{what}: the worker's golden data take {size >> 20} MiB")
    return os.pread(fd, size, 0)


def _judged(
    result: Mapping[str, Any],
    variants: Sequence[str],
    golden: bytes,
    allow_degraded: bool,
    what: str,
) -> tuple[Evaluation, dict[str, Any], dict[str, dict[str, Any]]]:
    """Turn the child's report into the version's figures, refusing what misses the bar."""
    llm = result.get("llm")
    scored = result.get("variants")
    if not isinstance(llm, dict) or not isinstance(scored, dict) or set(scored) != set(variants):
        raise errors.InvalidModel(f"{what}: the worker's report does not match the variants asked")
    signatures, accuracy, degraded, requirements = {}, {}, {}, {}
    below = []
    for name in variants:
        figures = scored[name]
        agreement = float(figures["top1_agreement"])
        accuracy[name] = {
            "top1_agreement": agreement,
            "mean_kl": float(figures["mean_kl"]),
            "min_top1": LLM_MIN_TOP1,
            "positions": int(figures["positions"]),
        }
        degraded[name] = agreement < LLM_MIN_TOP1
        if degraded[name]:
            below.append(f"{name}: top-1 agreement {agreement:.3f} below {LLM_MIN_TOP1}")
        requirements[name] = {
            "memory_mb": int(figures["memory_mb"]),
            "disk_mb": int(figures["disk_mb"]),
            "mnn": str(result["mnn_version"]).rsplit(".", 1)[0],
        }
        signatures[name] = {
            "inputs": [],
            "outputs": [],
            "mnn_version": str(result["mnn_version"]),
            "llm": {
                "architecture": str(llm["architecture"]),
                "vocab_size": int(llm["vocab_size"]),
                "context_length": int(llm["context_length"]),
                "layers": int(llm["layers"]),
                "hidden_size": int(llm["hidden_size"]),
                "chat_template": bool(llm["chat_template"]),
                "memory_mb": requirements[name]["memory_mb"],
                "disk_mb": requirements[name]["disk_mb"],
            },
        }
    if below and not allow_degraded:
        raise errors.InvalidModel(
            f"variants below the accuracy bar against the {what}'s reference: "
            + "; ".join(below)
            + " (push with --allow-degraded to keep them marked degraded)"
        )
    return Evaluation(signatures, accuracy, degraded, golden), dict(llm), requirements
