"""Shared by the real-model tests: find wheel data, convert, load, decode, score.

The numpy reference runs before MNN's first forward pass: MNN's worker threads keep
spinning after one and slow numpy down several times on a small machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from control_plane.registry.llm.convert import convert_gguf
from control_plane.registry.llm.gguf_source import GgufModel
from control_plane.registry.llm.reference import Reference
from runtime.llm.scoring import score

CONTINUATION = 16  # reference tokens scored teacher-forced


def load_bundle(bundle: Path) -> Any:
    import MNN.llm as llm

    m = llm.create(str(bundle / "config.json"))
    m.load()
    return m


def last_row(var: Any) -> np.ndarray:
    a = np.array(var.read(), dtype=np.float32)
    return a.reshape(-1, a.shape[-1])[-1]


def greedy(m: Any, ids: list[int], n: int, stop: set[int]) -> list[int]:
    """Greedy decoding token by token, the KV cache inside MNN."""
    m.reset()
    out: list[int] = []
    logits = m.forward(ids)
    for _ in range(n):
        nxt = int(np.argmax(last_row(logits)))
        if nxt in stop:
            break
        out.append(nxt)
        logits = m.forward([nxt])
    return out


def teacher_forced(m: Any, ids: list[int], continuation: list[int]) -> np.ndarray:
    """The bundle's next-token logits at each position of `continuation`."""
    m.reset()
    rows = [last_row(m.forward(ids))]
    rows += [last_row(m.forward([t])) for t in continuation[:-1]]
    return np.stack(rows)


@dataclass
class Converted:
    """A loaded bundle, a prompt's ids and the reference's view of them."""

    model: GgufModel
    llm: Any
    ids: list[int]
    continuation: list[int]  # the reference's greedy continuation
    want: np.ndarray  # reference logits predicting each continuation token

    def agreement(self) -> Any:
        return score(teacher_forced(self.llm, self.ids, self.continuation), self.want)


def convert_and_reference(
    model: GgufModel, out: Path, variant: str, prompt: str, chat: bool
) -> Converted:
    """Convert and load; run the numpy reference before MNN's first forward pass.

    MNN's worker threads keep spinning after a forward pass and slow numpy down several
    times on a small machine, so the reference goes first.
    """
    convert_gguf(model, out, variant=variant)
    m = load_bundle(out)
    ids = m.tokenizer_encode(m.apply_chat_template(prompt) if chat else prompt)
    ref = Reference(model)
    continuation = ref.greedy(ids, CONTINUATION)
    want = ref.logits(ids + continuation)[len(ids) - 1 : -1]
    return Converted(model, m, ids, continuation, want)
