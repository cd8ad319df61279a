"""The worker's ``llm`` op for a published MNN-LLM bundle (what MNN's `llmexport` writes).

Runs inside the registry's confined MNN child, as the GGUF conversion does
(`control_plane.registry.llm.build`). The upload is a tar (the CLI packs a bundle
directory into the canonical one): it is read without trusting it into sealed memfds
(`runtime.llm.read_bundle_tar`: flat regular files with the bundle's own names, nothing
else), and its configs are checked (`validate_bundle`: files it names must be its own;
vision, audio and speculative parts are refused).

A bundle has no higher-precision source to compare with: it is its own reference. Its
greedy answers to the golden prompts are recorded (what a device's self-test must
reproduce), and its agreement with them, teacher-forced, is measured as the device will
measure it. What a device needs to fit it is measured as for a converted bundle: its size,
the memory its runs took, and the KV cache a full context adds.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from contract import errors
from control_plane.registry.llm.build import (
    GOLDEN_SCHEMA,
    MemoryProbe,
    ceil_mb,
    prompt_ids,
    until_stop,
)
from control_plane.registry.llm.convert import release_freed_memory
from runtime.llm.bundle import BundleInfo, close_files, read_bundle_tar, write_bundle_fds
from runtime.llm.session import LlmSession, Sampling

__all__ = ["judge_bundle"]

# What a bundle's `model_type` may say to be shown as its architecture.
_ARCHITECTURE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def judge_bundle(
    src_path: str, recipe: Mapping[str, Any], outputs: Mapping[str, int], golden_fd: int
) -> dict[str, Any]:
    """Check, measure and repack one bundle; write its golden generations to `golden_fd`."""
    (name,) = recipe["variants"]
    with open(src_path, "rb") as src:
        files = read_bundle_tar(src)
    try:
        info = write_bundle_fds(files, outputs[name])  # validated, then the canonical tar
        chat = info.chat_template is not None
        defaults = recipe["default_prompts"]["chat" if chat else "completion"]
        prompts = [str(p) for p in (recipe["prompts"] or defaults)]
        new_tokens = int(recipe["new_tokens"])
        release_freed_memory()
        probe = MemoryProbe()
        with LlmSession(files, threads=1) as session:
            answers, greedy, texts = _answers(session, prompts, new_tokens, chat)
            hits = total = 0
            for answer in answers:
                continuation = answer["reference"]
                if continuation:
                    logits = session.logits(answer["ids"], continuation)
                    hits += int(np.sum(np.argmax(logits, axis=-1) == np.asarray(continuation)))
                    total += len(continuation)
            peak = probe.used_bytes()
            vocab = session.vocab_size
        disk_mb = ceil_mb(sum(os.fstat(fd).st_size for fd in files.values()))
        memory_mb = disk_mb + ceil_mb(peak + _kv_cache_bytes(info))
    finally:
        close_files(files)
    if not total:
        raise errors.InvalidModel("MNN-LLM bundle: it answered no golden prompt with a token")
    agreement = hits / total
    golden = {
        "schema": GOLDEN_SCHEMA,
        "new_tokens": new_tokens,
        "reference": "the bundle itself",
        "prompts": answers,
        "variants": {name: {"greedy": greedy, "texts": texts, "top1_agreement": agreement}},
    }
    os.pwrite(golden_fd, json.dumps(golden, ensure_ascii=False).encode(), 0)
    import MNN

    merged = {**info.config, **info.llm_config}
    architecture = merged.get("model_type")
    if not (isinstance(architecture, str) and _ARCHITECTURE.fullmatch(architecture)):
        architecture = "unknown"  # a name for people's terminals: never raw bytes
    return {
        "llm": {
            "architecture": architecture,
            "vocab_size": vocab,
            "context_length": info.context_length,
            "layers": info.layer_nums,
            "hidden_size": info.hidden_size,
            "chat_template": chat,
        },
        "variants": {
            name: {
                "top1_agreement": agreement,
                "mean_kl": 0.0,  # against itself
                "positions": total,
                "disk_mb": disk_mb,
                "memory_mb": memory_mb,
            }
        },
        "mnn_version": MNN.version(),
    }


def _answers(session: LlmSession, prompts: list[str], new_tokens: int, chat: bool):
    """Answer each prompt greedily, tokenized as a device will (its chat template, if any)."""
    answers, greedy, texts = [], [], []
    for text in prompts:
        ids = prompt_ids(session, text, new_tokens)
        deltas = list(session.generate(ids, max_new_tokens=new_tokens, sampling=Sampling()))
        out = list(deltas[-1].summary.output_ids)
        reference = until_stop(session, out)  # as a GGUF's reference continuation ends
        answers.append({"text": text, "chat": chat, "ids": ids, "reference": reference})
        greedy.append(out)
        texts.append("".join(d.text for d in deltas))
    return answers, greedy, texts


def _kv_cache_bytes(info: BundleInfo) -> int:
    """Return a full context's fp16 KV cache.

    From `key_value_shape` when the config says it ([2, 1, 0, kv_heads, head_dim], as
    MNN's exporter writes it), else as if every head had its own K and V (hidden_size per
    layer), an upper bound.
    """
    merged = {**info.config, **info.llm_config}
    shape = merged.get("key_value_shape")
    per_token = info.hidden_size
    if isinstance(shape, list) and len(shape) >= 2:
        tail = [x for x in shape[-2:] if isinstance(x, int) and not isinstance(x, bool)]
        if len(tail) == 2 and all(0 < x <= 1 << 16 for x in tail):
            per_token = tail[0] * tail[1]
    return 2 * info.layer_nums * per_token * 2 * info.context_length
