"""The worker's ``llm`` op: GGUF -> one MNN-LLM bundle per variant, each judged.

Runs inside the registry's confined MNN child (`control_plane.registry.mnn_worker`). Every
bundle file is written through a symlink to its own memfd, in the child's private working
directory, so the converter's outputs never reach a disk; each bundle then leaves as the
canonical tar (`runtime.llm.bundle`) in the memfd the parent gave for it.

The reference is an independent fp32 numpy forward pass of the GGUF's own weights
(`reference.Reference`): it writes a greedy continuation of each golden prompt, and each
variant, loaded with MNN-LLM exactly as a device loads it, is teacher-forced on those
continuations and scored (`runtime.llm.scoring`). What a device needs to fit a variant is
measured here too: the bundle's size, and the peak memory while it generated, plus the
KV cache a full context adds.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from contract import errors
from control_plane.registry.llm.convert import convert_gguf, release_freed_memory
from control_plane.registry.llm.gguf_source import GgufModel, open_gguf
from control_plane.registry.llm.reference import Reference
from runtime.llm.bundle import BUNDLE_FILES, write_bundle_fds
from runtime.llm.scoring import score
from runtime.llm.session import LlmSession, Sampling

__all__ = ["GOLDEN_SCHEMA", "MemoryProbe", "build", "ceil_mb", "prompt_ids", "until_stop"]

GOLDEN_SCHEMA = "skiff.llm-golden/v1"
_MiB = 1 << 20


def build(
    src_path: str, recipe: Mapping[str, Any], outputs: Mapping[str, int], golden_fd: int
) -> dict[str, Any]:
    """Convert, judge and pack every variant; write the golden generations to `golden_fd`.

    A recipe whose source is "bundle" holds a published MNN-LLM bundle instead
    (`bundle_judge`).
    """
    if recipe.get("source") == "bundle":
        from control_plane.registry.llm.bundle_judge import judge_bundle

        return judge_bundle(src_path, recipe, outputs, golden_fd)
    model = open_gguf(src_path)
    reference = Reference(model)
    chat = bool(model.tokenizer.chat_template)
    defaults = recipe["default_prompts"]["chat" if chat else "completion"]
    prompts = [str(p) for p in (recipe["prompts"] or defaults)]
    new_tokens = int(recipe["new_tokens"])
    golden: dict[str, Any] = {
        "schema": GOLDEN_SCHEMA,
        "new_tokens": new_tokens,
        "prompts": [],
        "variants": {},
    }
    scored: dict[str, Any] = {}
    expected = np.empty((0, 0), np.float32)  # the reference's rows, from the first variant on
    for name in recipe["variants"]:
        # Absolute: the converter changes the working directory while it runs.
        with _memfd_bundle_dir(Path.cwd() / f"bundle-{name}") as (directory, fds):
            started = time.perf_counter()
            convert_gguf(model, directory, variant=name, block=int(recipe["block"]))
            converted = time.perf_counter() - started
            files = _written(directory, fds)
            if not golden["prompts"]:  # tokenized as a device will, answered by the reference
                with LlmSession(files, threads=1) as session:
                    golden["prompts"] = _reference_answers(session, reference, prompts, new_tokens)
                expected = _reference_rows(reference, golden["prompts"])
            # Measured from here: the engine's load, its runs, nothing of the reference's
            # (and no freed memory to reuse: it goes back to the system first).
            release_freed_memory()
            probe = MemoryProbe()
            with LlmSession(files, threads=1) as session:
                scored[name] = _judge(session, expected, golden["prompts"], new_tokens)
                peak = probe.used_bytes()
                kv_cache = _kv_cache_bytes(model, session.context_length)
            golden["variants"][name] = {
                "greedy": scored[name].pop("greedy"),  # token ids: what the self-test checks
                "texts": scored[name].pop("texts"),  # the same, for people
                "top1_agreement": scored[name]["top1_agreement"],
            }
            write_bundle_fds(files, outputs[name])
            scored[name]["convert_s"] = converted
            scored[name]["disk_mb"] = ceil_mb(sum(os.fstat(fd).st_size for fd in files.values()))
            # The memfds hold the bundle; the engine what it loaded and ran; a full
            # context's KV cache comes on top of the short golden runs.
            scored[name]["memory_mb"] = scored[name]["disk_mb"] + ceil_mb(peak + kv_cache)
    os.pwrite(golden_fd, json.dumps(golden, ensure_ascii=False).encode(), 0)
    import MNN

    return {"llm": _describe(model), "variants": scored, "mnn_version": MNN.version()}


@contextlib.contextmanager
def _memfd_bundle_dir(directory: Path) -> Iterator[tuple[Path, dict[str, int]]]:
    """Yield a directory whose every bundle file name is a symlink to its own memfd."""
    directory.mkdir(mode=0o700)
    fds: dict[str, int] = {}
    try:
        for name in sorted(BUNDLE_FILES):
            fds[name] = os.memfd_create(f"skiff-llm-{name}", os.MFD_CLOEXEC)
            os.symlink(f"/proc/self/fd/{fds[name]}", directory / name)
        yield directory, fds
    finally:
        for entry in directory.iterdir():
            entry.unlink()
        directory.rmdir()
        for fd in fds.values():
            os.close(fd)


def _written(directory: Path, fds: Mapping[str, int]) -> dict[str, int]:
    """Return the bundle's files: the memfds written; refuse anything that reached the disk."""
    for entry in directory.iterdir():
        if not entry.is_symlink():
            raise errors.InvalidModel(
                f"the converter wrote {entry.name} to disk instead of memory: refused"
            )
    return {name: fd for name, fd in fds.items() if os.fstat(fd).st_size > 0}


def _reference_answers(
    session: LlmSession, reference: Reference, prompts: list[str], new_tokens: int
) -> list[dict[str, Any]]:
    """Tokenize each prompt as a device will (its chat template, if any); answer greedily."""
    answers = []
    for text in prompts:
        ids = prompt_ids(session, text, new_tokens)
        continuation = until_stop(session, reference.greedy(ids, new_tokens))
        chat = session.info.chat_template is not None
        answers.append({"text": text, "chat": chat, "ids": ids, "reference": continuation})
    return answers


def prompt_ids(session: LlmSession, text: str, new_tokens: int) -> list[int]:
    """Tokenize a golden prompt as a device will (its chat template, if any), checked to fit."""
    chat = session.info.chat_template is not None
    rendered = session.apply_chat_template([{"role": "user", "content": text}]) if chat else text
    ids = session.encode(rendered)
    if len(ids) + new_tokens > session.context_length:
        raise errors.InvalidArgument(
            f"golden prompt {text[:40]!r} is {len(ids)} tokens: with the {new_tokens}-token "
            f"answer it does not fit the {session.context_length}-token context"
        )
    return ids


def until_stop(session: LlmSession, continuation: list[int]) -> list[int]:
    """Return a continuation up to its first stop token (what follows is served to nobody)."""
    ends = [i for i, t in enumerate(continuation) if t in session.stop_token_ids]
    return continuation[: ends[0] + 1] if ends else continuation


def _reference_rows(reference: Reference, answers: list[dict[str, Any]]) -> np.ndarray:
    """Return the reference's logits at every golden position (teacher-forced), stacked."""
    rows = []
    for answer in answers:
        ids, continuation = answer["ids"], answer["reference"]
        full = reference.logits(ids + continuation[:-1])
        rows.append(full[len(ids) - 1 :])
    return np.concatenate(rows)


def _judge(
    session: LlmSession, expected: np.ndarray, answers: list[dict[str, Any]], new_tokens: int
) -> dict[str, Any]:
    """Score the variant, teacher-forced, and record its own greedy answers."""
    candidate, greedy, texts = [], [], []
    for answer in answers:
        candidate.append(session.logits(answer["ids"], answer["reference"]))
        deltas = list(
            session.generate(answer["ids"], max_new_tokens=new_tokens, sampling=Sampling())
        )
        greedy.append(list(deltas[-1].summary.output_ids))
        texts.append("".join(d.text for d in deltas))
    agreement = score(np.concatenate(candidate), expected)
    return {
        "top1_agreement": agreement.top1,
        "mean_kl": agreement.mean_kl,
        "positions": agreement.n,
        "greedy": greedy,
        "texts": texts,
    }


def _kv_cache_bytes(model: GgufModel, context_length: int) -> int:
    """Return what a full context's KV cache adds to the short golden runs (fp16 K and V)."""
    return 2 * model.n_layers * model.kv_heads * model.head_dim * 2 * context_length


def _describe(model: GgufModel) -> dict[str, Any]:
    return {
        "architecture": model.arch,
        "vocab_size": model.vocab,
        "context_length": model.context_length,
        "layers": model.n_layers,
        "hidden_size": model.hidden,
        "chat_template": bool(model.tokenizer.chat_template),
    }


def ceil_mb(n: int) -> int:
    """Return `n` bytes in MiB, rounded up."""
    return -(-n // _MiB)


class MemoryProbe:
    """What the process takes from here on.

    The peak when it can be reset; else (a non-dumpable process, as the sandboxed child
    is, may not write /proc/self/clear_refs) what it holds when asked, its session still
    open.
    """

    def __init__(self) -> None:
        self._before = _rss_kb()
        self._reset = _reset_peak()

    def used_bytes(self) -> int:
        """Return the bytes taken since the probe began."""
        now = _peak_kb() if self._reset else _rss_kb()
        return max(now - self._before, 0) * 1024


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _rss_kb() -> int:
    return _status_kb("VmRSS")


def _peak_kb() -> int:
    return _status_kb("VmHWM")


def _reset_peak() -> bool:
    """Reset the peak RSS to the current one (Linux >= 4.0); False when not allowed."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
    except OSError:
        return False
    return True
