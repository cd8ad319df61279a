"""The numpy reference's cached greedy decoding is its full forward pass, step by step.

`Reference.greedy` keeps each layer's keys and values between steps; `Reference.logits`
recomputes the whole sequence. On tiny llama and Gemma 3 layouts (Gemma's sliding window
of 8 shorter than the sequence, so the window's edge moves while decoding) both must give
the same hidden states and the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from control_plane.registry.llm.gguf_source import open_gguf
from control_plane.registry.llm.reference import Reference
from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gemma3, write_tiny_gguf

PROMPT = [2, 40, 41, 42, 43]
STEPS = 14  # past the sliding window of 8


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def reference(request, tmp_path_factory) -> Reference:
    path = tmp_path_factory.mktemp("reference") / f"{request.param}.gguf"
    if request.param == "gemma3":
        write_tiny_gemma3(path)
    else:
        write_tiny_gguf(path)
    return Reference(open_gguf(path))


def _recomputed_greedy(reference: Reference, ids: list[int], n: int) -> list[int]:
    """Greedy decoding as it was before the cache: the whole sequence at every step."""
    seq = list(ids)
    for _ in range(n):
        seq.append(int(np.argmax(reference.logits(seq)[-1])))
    return seq[len(ids) :]


def test_cached_greedy_is_recomputed_greedy(reference: Reference) -> None:
    assert reference.greedy(PROMPT, STEPS) == _recomputed_greedy(reference, PROMPT, STEPS)
    assert reference.greedy(PROMPT, 0) == []
    assert reference.greedy(PROMPT, 1) == _recomputed_greedy(reference, PROMPT, 1)


def test_each_cached_step_has_the_full_pass_hidden_state(reference: Reference) -> None:
    """One position at a time, then several at once: the same rows as the whole pass."""
    seq = PROMPT + [50 + i for i in range(STEPS)] + [60, 61, 62]
    full = reference._hidden(seq)
    cache: list = []
    rows = [reference._hidden(PROMPT, cache)]
    rows += [reference._hidden([t], cache) for t in seq[len(PROMPT) : -3]]
    rows.append(reference._hidden(seq[-3:], cache))
    assert len(cache) == reference.model.n_layers and cache[0][0].shape[0] == len(seq)
    np.testing.assert_allclose(np.concatenate(rows), full, rtol=1e-4, atol=1e-4)


def test_a_model_without_a_sliding_window_sees_the_whole_prefix(tmp_path: Path) -> None:
    """A token far back changes the last step's state: the cache is not a window."""
    path = tmp_path / "llama.gguf"
    write_tiny_gguf(path)
    ref = Reference(open_gguf(path))
    a, b = [2, 40, *range(41, 55)], [2, 44, *range(41, 55)]
    cache_a, cache_b = [], []
    ref._hidden(a[:-1], cache_a), ref._hidden(b[:-1], cache_b)
    last_a, last_b = ref._hidden(a[-1:], cache_a), ref._hidden(b[-1:], cache_b)
    assert not np.allclose(last_a, last_b)
    np.testing.assert_allclose(last_a, ref._hidden(a)[-1:], rtol=1e-4, atol=1e-4)
