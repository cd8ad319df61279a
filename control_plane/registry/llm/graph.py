"""Build an MNN-LLM ``llm.mnn`` graph from a `GgufModel` with MNN.expr (no torch, no ONNX).

The graph follows MNN-LLM's contract (see FACTS.md "MNN-LLM"): inputs ``input_ids`` (really
the token embeddings, ``[seq, 1, hidden]``), ``attention_mask`` (a scalar 0 on CPU means
causal; for gemma3 a ``[2, 1, 1, seq, kv]`` float mask, full then sliding), ``position_ids``
``[1, seq]`` and ``logits_index`` ``[1]`` (-1: last token only, 0: every token); output
``logits`` ``[1, n, vocab]``. The KV cache lives inside MNN's ``Attention`` op, reached
through a jsonop because MNN.expr has no builder for it.

Each linear is a MatMul against a constant with transposeB plus a zero bias: that is the
pattern MNN's converter turns into a quantizable fully-connected convolution.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from control_plane.registry.llm.gguf_source import GgufModel

__all__ = ["build_graph"]

_ATTENTION = '{"type":"Attention","main_type":"AttentionParam","main":{"kv_cache":true}}'


def build_graph(model: GgufModel, progress: Any = None) -> list[Any]:
    """Return the graph's outputs (``[logits]``), built layer by layer from fp32 weights."""
    import MNN

    F = MNN.expr
    h = model.hidden
    ids = F.placeholder([-1, 1, h], F.NCHW, F.float)
    ids.name = "input_ids"
    mask_shape = [2, 1, 1, -1, -1] if model.arch == "gemma3" else []
    mask = F.placeholder(mask_shape, F.NCHW, F.float)
    mask.name = "attention_mask"
    pos = F.placeholder([1, -1], F.NCHW, F.int)
    pos.name = "position_ids"
    logits_index = F.placeholder([1], F.NCHW, F.int)
    logits_index.name = "logits_index"

    x = F.reshape(ids, [-1, h])
    if model.arch == "gemma3":
        x = x * F.scalar(math.sqrt(h))  # embeddings are stored unscaled
    ropes = {base: _rope_tables(F, pos, model.head_dim, base) for base in _bases(model)}
    masks = _layer_masks(F, model, mask)
    for i in range(model.n_layers):
        base = model.rope_base_local if model.is_sliding(i) else model.rope_base
        x = _layer(F, model, i, x, ropes[base], masks[model.is_sliding(i)])
        if progress is not None:
            progress(i + 1, model.n_layers)
    x = _select_rows(F, x, logits_index)
    x = _rms_norm(F, x, model.tensor("output_norm.weight"), model.rms_eps)
    head = "token_embd.weight" if model.tied_embeddings else "output.weight"
    logits = F.reshape(_linear(F, x, model.tensor(head)), [1, -1, model.vocab])
    logits.name = "logits"
    return [logits]


def _bases(model: GgufModel) -> set[float]:
    return {
        model.rope_base_local if model.is_sliding(i) else model.rope_base
        for i in range(model.n_layers)
    }


def _layer_masks(F: Any, model: GgufModel, mask: Any) -> dict[bool, Any]:
    """Per-layer masks: gemma3 picks full (0) or sliding (1) from the stacked mask."""
    if model.arch != "gemma3":
        return {False: mask, True: mask}
    full, sliding = F.unstack(mask, 0)
    return {False: full, True: sliding}


def _layer(F: Any, m: GgufModel, i: int, x: Any, rope: tuple[Any, Any], mask: Any) -> Any:
    p = f"blk.{i}."
    t = m.tensor
    hd = m.head_dim
    y = _rms_norm(F, x, t(p + "attn_norm.weight"), m.rms_eps)
    q = _linear(F, y, t(p + "attn_q.weight"), _bias(m, p + "attn_q.bias"))
    k = _linear(F, y, t(p + "attn_k.weight"), _bias(m, p + "attn_k.bias"))
    v = _linear(F, y, t(p + "attn_v.weight"), _bias(m, p + "attn_v.bias"))
    q = F.reshape(q, [1, -1, m.heads, hd])
    k = F.reshape(k, [1, -1, m.kv_heads, hd])
    v = F.reshape(v, [1, -1, m.kv_heads, hd])
    if m.arch == "gemma3":
        q = _rms_norm(F, q, t(p + "attn_q_norm.weight"), m.rms_eps)
        k = _rms_norm(F, k, t(p + "attn_k_norm.weight"), m.rms_eps)
    q, k = _apply_rope(F, q, rope, hd), _apply_rope(F, k, rope, hd)
    a = F.jsonop([q, k, v, mask], _ATTENTION, 1)[0]  # repr is empty until it is run
    a = F.reshape(a, [-1, m.heads * hd])
    a = _linear(F, a, t(p + "attn_output.weight"))
    if m.arch == "gemma3":
        a = _rms_norm(F, a, t(p + "post_attention_norm.weight"), m.rms_eps)
    x = x + a
    y = _rms_norm(F, x, t(p + "ffn_norm.weight"), m.rms_eps)
    gate = _linear(F, y, t(p + "ffn_gate.weight"))
    up = _linear(F, y, t(p + "ffn_up.weight"))
    act = _gelu_tanh(F, gate) if m.arch == "gemma3" else gate * F.sigmoid(gate)
    y = _linear(F, act * up, t(p + "ffn_down.weight"))
    if m.arch == "gemma3":
        y = _rms_norm(F, y, t(p + "post_ffw_norm.weight"), m.rms_eps)
    return x + y


def _bias(m: GgufModel, name: str) -> np.ndarray | None:
    return m.tensor(name) if m.has(name) else None


def _linear(F: Any, x: Any, w: np.ndarray, b: np.ndarray | None = None) -> Any:
    """X @ w.T + b, written the way MNN's converter recognises as a quantizable FC layer."""
    weight = F.const(np.ascontiguousarray(w, np.float32), list(w.shape), F.NCHW, F.float)
    bias_np = np.zeros(w.shape[0], np.float32) if b is None else b.astype(np.float32)
    bias = F.const(bias_np, [w.shape[0]], F.NCHW, F.float)
    return F.matmul(x, weight, False, True) + bias


def _rms_norm(F: Any, x: Any, w: np.ndarray, eps: float) -> Any:
    var = F.reduce_mean(F.square(x), [-1], True)
    weight = F.const(w.astype(np.float32), [w.shape[0]], F.NCHW, F.float)
    return x * F.rsqrt(var + F.scalar(float(eps))) * weight


def _gelu_tanh(F: Any, x: Any) -> Any:
    c = math.sqrt(2.0 / math.pi)
    inner = F.scalar(c) * (x + F.scalar(0.044715) * x * x * x)
    return F.scalar(0.5) * x * (F.scalar(1.0) + F.tanh(inner))


def _rope_tables(F: Any, pos: Any, head_dim: int, base: float) -> tuple[Any, Any]:
    """Cos and sin of shape [1, seq, 1, head_dim/2] for rotate-half RoPE."""
    half = head_dim // 2
    inv = (1.0 / base ** (np.arange(0, half, dtype=np.float64) * 2 / head_dim)).astype(np.float32)
    inv_freq = F.const(inv, [1, 1, half], F.NCHW, F.float)
    angles = F.reshape(F.cast(pos, F.float), [1, -1, 1]) * inv_freq  # [1, seq, half]
    angles = F.reshape(angles, [1, -1, 1, half])
    return F.cos(angles), F.sin(angles)


def _apply_rope(F: Any, x: Any, rope: tuple[Any, Any], head_dim: int) -> Any:
    cos, sin = rope
    x1, x2 = F.split(x, [head_dim // 2, head_dim // 2], -1)
    return F.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _select_rows(F: Any, x: Any, logits_index: Any) -> Any:
    """Rows logits_index.. of x [seq, h]; a negative index counts from the end (-1: last)."""
    seq = F.gather(F.shape(x), F.const(np.array([0], np.int32), [1], F.NCHW, F.int))
    zero = F.const(np.array([0], np.int32), [], F.NCHW, F.int)
    one = F.const(np.array([1], np.int32), [], F.NCHW, F.int)
    start = logits_index + seq * F.cast(F.less(logits_index, zero), F.int)  # -1 -> seq - 1
    idx = F.range(F.squeeze(start, [0]), F.squeeze(seq, [0]), one)
    return F.gather(x, idx)
