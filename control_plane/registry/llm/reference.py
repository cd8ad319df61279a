"""An independent numpy fp32 forward pass over a `GgufModel`, to check converted bundles.

It shares nothing with the MNN graph builder but the dequantized weights. `logits` runs
full causal attention over the whole sequence; `greedy` keeps each layer's keys and values
between its steps, so a step runs its one new position, not the whole sequence again
(the same arithmetic: tests/control_plane/registry/llm/test_reference.py). Follows HF's
llama / Gemma 3 implementations (rotate-half RoPE on un-permuted weights).
"""

from __future__ import annotations

import math

import numpy as np

from control_plane.registry.llm.gguf_source import GgufModel

__all__ = ["Reference"]

# Each layer's keys (after RoPE) and values of the positions already run: [pos, kv_heads, dim].
KvCache = list[tuple[np.ndarray, np.ndarray]]


class Reference:
    """fp32 logits for a token sequence; weights are dequantized once and kept."""

    def __init__(self, model: GgufModel) -> None:
        self.model = model
        self._w: dict[str, np.ndarray] = {}

    def _t(self, name: str) -> np.ndarray:
        if name not in self._w:
            self._w[name] = self.model.tensor(name)
        return self._w[name]

    def logits(self, ids: list[int]) -> np.ndarray:
        """Return logits [len(ids), vocab] for every position of `ids`."""
        return self._head(self._hidden(ids))

    def greedy(self, ids: list[int], n: int) -> list[int]:
        """Return the `n` tokens greedy decoding appends to `ids`.

        The prompt runs once; each step then runs only its new token, against the keys
        and values the positions before it left in the cache. Only the last position goes
        through the output head: with Gemma's 262k vocabulary the head dominates a step.
        """
        out: list[int] = []
        cache: KvCache = []
        x = self._hidden(ids, cache) if n > 0 else None
        while len(out) < n:
            out.append(int(np.argmax(self._head(x[-1:])[0])))
            if len(out) < n:
                x = self._hidden(out[-1:], cache)
        return out

    def _head(self, x: np.ndarray) -> np.ndarray:
        m = self.model
        head = "token_embd.weight" if m.tied_embeddings else "output.weight"
        return x @ self._t(head).T

    def _hidden(self, ids: list[int], cache: KvCache | None = None) -> np.ndarray:
        """Return the final-normed hidden states [len(ids), hidden].

        With `cache`, `ids` follow the positions it holds (none, at first), and their keys
        and values are appended to it; without, `ids` are the whole sequence.
        """
        m = self.model
        emb = self._t("token_embd.weight")
        x = emb[np.asarray(ids, np.int64)].astype(np.float32)
        if m.arch == "gemma3":
            x = x * np.float32(math.sqrt(m.hidden))
        start = cache[0][0].shape[0] if cache else 0
        end = start + len(ids)
        for i in range(m.n_layers):
            window = m.sliding_window if m.is_sliding(i) else 0
            base = m.rope_base_local if m.is_sliding(i) else m.rope_base
            cos, sin = _rope(end, m.head_dim, base)
            rope = (cos[start:], sin[start:])
            x = self._layer(i, x, _mask(end, window)[start:], rope, cache)
        return _rms(x, self._t("output_norm.weight"), m.rms_eps)

    def _linear(self, x: np.ndarray, name: str) -> np.ndarray:
        y = x @ self._t(name + ".weight").T
        bias = name + ".bias"
        return y + self._t(bias) if self.model.has(bias) else y

    def _layer(
        self,
        i: int,
        x: np.ndarray,
        mask: np.ndarray,
        rope: tuple[np.ndarray, np.ndarray],
        cache: KvCache | None = None,
    ) -> np.ndarray:
        m, p, n = self.model, f"blk.{i}.", x.shape[0]
        gemma = m.arch == "gemma3"
        y = _rms(x, self._t(p + "attn_norm.weight"), m.rms_eps)
        q = self._linear(y, p + "attn_q").reshape(n, m.heads, m.head_dim)
        k = self._linear(y, p + "attn_k").reshape(n, m.kv_heads, m.head_dim)
        v = self._linear(y, p + "attn_v").reshape(n, m.kv_heads, m.head_dim)
        if gemma:
            q = _rms(q, self._t(p + "attn_q_norm.weight"), m.rms_eps)
            k = _rms(k, self._t(p + "attn_k_norm.weight"), m.rms_eps)
        q, k = _apply_rope(q, *rope), _apply_rope(k, *rope)
        if cache is not None:
            if i < len(cache):
                k = np.concatenate([cache[i][0], k])
                v = np.concatenate([cache[i][1], v])
                cache[i] = (k, v)
            else:
                cache.append((k, v))
        rep = m.heads // m.kv_heads
        k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.float32(math.sqrt(m.head_dim)) + mask
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        a = np.einsum("hqk,khd->qhd", probs, v).reshape(n, m.heads * m.head_dim)
        a = self._linear(a, p + "attn_output")
        if gemma:
            a = _rms(a, self._t(p + "post_attention_norm.weight"), m.rms_eps)
        x = x + a
        y = _rms(x, self._t(p + "ffn_norm.weight"), m.rms_eps)
        gate, up = self._linear(y, p + "ffn_gate"), self._linear(y, p + "ffn_up")
        act = _gelu_tanh(gate) if gemma else gate / (1.0 + np.exp(-gate))
        y = self._linear(act * up, p + "ffn_down")
        if gemma:
            y = _rms(y, self._t(p + "post_ffw_norm.weight"), m.rms_eps)
        return (x + y).astype(np.float32)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    var = np.mean(np.square(x), axis=-1, keepdims=True)
    return (x / np.sqrt(var + eps) * w).astype(np.float32)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _mask(n: int, window: int) -> np.ndarray:
    """Additive causal mask [n, n]; with a window, key j is visible from q iff q-window < j.

    Row q is position q's: a cached step takes the rows of its new positions.
    """
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    allowed = k <= q
    if window:
        allowed &= k > q - window
    return np.where(allowed, 0.0, -np.inf).astype(np.float32)


def _rope(n: int, head_dim: int, base: float) -> tuple[np.ndarray, np.ndarray]:
    half = head_dim // 2
    inv = 1.0 / base ** (np.arange(half, dtype=np.float64) * 2 / head_dim)
    ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
    return np.cos(ang).astype(np.float32)[:, None, :], np.sin(ang).astype(np.float32)[:, None, :]


def _apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
