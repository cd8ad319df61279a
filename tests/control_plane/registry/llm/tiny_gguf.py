"""Tiny synthetic GGUFs: real enough for MNN-LLM and the reference, converted in a second.

`write_tiny_gguf`: llama, 2 layers, hidden 64, a ~300-token byte-level BPE vocabulary.
`write_tiny_gemma3`: gemma3, 6 layers (the sixth global), a SentencePiece vocabulary with
scores, byte pieces, user-defined and control pieces, so the ``.mtok`` path runs fast.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def _byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table (printable stand-ins for the 256 bytes)."""
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars, n = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + n))
            n += 1
    return chars


def write_tiny_gguf(path: Path, *, arch: str = "llama", layers: int = 2, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    h, heads, kv, ffn = 64, 4, 2, 128
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", *_byte_chars()]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a t"]
    for m in merges:
        tokens.append(m.replace(" ", ""))
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}"
    )

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    t("token_embd.weight", vocab, h, scale=1.0)
    w.add_tensor("output_norm.weight", np.ones(h, np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
        w.add_tensor(p + "ffn_norm.weight", (1 + 0.1 * rng.standard_normal(h)).astype(np.float32))
        t(p + "attn_q.weight", heads * 16, h)
        t(p + "attn_k.weight", kv * 16, h)
        t(p + "attn_v.weight", kv * 16, h)
        t(p + "attn_output.weight", h, heads * 16)
        t(p + "ffn_gate.weight", ffn, h)
        t(p + "ffn_up.weight", ffn, h)
        t(p + "ffn_down.weight", h, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


SPM_PIECES = ["▁t", "he", "▁the", "▁a", "in", "er", "▁in", "on", "▁c", "at", "▁cat", "an"]


def write_tiny_gemma3(path: Path, *, layers: int = 6, seed: int = 0) -> None:
    import gguf

    rng = np.random.default_rng(seed)
    h, heads, kv, hd, ffn = 64, 2, 1, 32, 128
    control = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = [*control, "\n", "  ", *(f"<0x{b:02X}>" for b in range(256))]
    types = [3] * len(control) + [4, 4] + [6] * 256
    scores = [-1000.0] * (len(control) + 2) + [0.0] * 256
    chars = list("▁abcdefghijklmnopqrstuvwxyzTHé")
    for rank, piece in enumerate(SPM_PIECES + chars):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(layers)
    w.add_context_length(1024)
    w.add_embedding_length(h)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(8)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_scores(scores)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)

    def t(name: str, *shape: int, scale: float = 0.2) -> None:
        w.add_tensor(name, (rng.standard_normal(shape) * scale).astype(np.float32))

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(n)).astype(np.float32))

    t("token_embd.weight", vocab, h, scale=0.2)
    norm("output_norm.weight", h)
    for i in range(layers):
        p = f"blk.{i}."
        for n in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            norm(p + n + ".weight", h)
        norm(p + "attn_q_norm.weight", hd)
        norm(p + "attn_k_norm.weight", hd)
        t(p + "attn_q.weight", heads * hd, h)
        t(p + "attn_k.weight", kv * hd, h)
        t(p + "attn_v.weight", kv * hd, h)
        t(p + "attn_output.weight", h, heads * hd)
        t(p + "ffn_gate.weight", ffn, h)
        t(p + "ffn_up.weight", ffn, h)
        t(p + "ffn_down.weight", h, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
