"""Write a GGUF tokenizer in one of MNN-LLM's tokenizer file formats.

Formats (read from MNN 3.6.1's ``transformers/llm/engine/src/tokenizer/tokenizer.cpp`` and
``transformers/llm/export/utils/tokenizer.py``): a text header ``430 <type>``, then
``<n_special> <n_stop> <n_prefix>`` and those ids on one line, then a type-specific body.

- gpt2 byte-level BPE -> ``tokenizer.txt`` type 3 (HUGGINGFACE): ``<vocab> <merges>``, one
  token a line in byte-level unicode form, then one ``a b`` merge a line.
- llama (SentencePiece scores, Gemma 3) -> ``tokenizer.mtok`` type 4 (PIPELINE): a binary
  body describing a HF ``tokenizers`` pipeline; BPE merges are rebuilt from the scores, the
  way HF's converter does, with byte fallback.
"""

from __future__ import annotations

import struct
from pathlib import Path

from contract import errors
from control_plane.registry.llm.gguf_source import GgufModel, Tokenizer

__all__ = ["stop_ids", "write_tokenizer"]

MAGIC = 430
HUGGINGFACE, PIPELINE = 3, 4
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4
_SPACE = "\u2581"  # SentencePiece's visible space
# Type tags of MNN's binary pipeline sections.
_NORM_PREPEND, _NORM_REPLACE, _NORM_SEQUENCE, _PRE_NONE, _MODEL_BPE = 2, 3, 4, 0, 0
_DEC_BYTE_FALLBACK, _DEC_FUSE, _DEC_REPLACE, _DEC_SEQUENCE = 1, 4, 5, 7
# Turn terminators of common chat formats: generation stops at any of these.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "</s>")


def stop_ids(tok: Tokenizer) -> list[int]:
    """Ids that end a reply: the eos token and the usual turn terminators present."""
    ids = [] if tok.eos_id is None else [tok.eos_id]
    index = {t: i for i, t in enumerate(tok.tokens) if t in _STOP_TOKENS}
    return ids + [i for t, i in index.items() if i not in ids]


def write_tokenizer(model: GgufModel, out_dir: Path) -> str:
    """Write the tokenizer file into `out_dir`; return its name."""
    tok = model.tokenizer
    if tok.model == "gpt2":
        (out_dir / "tokenizer.txt").write_bytes(_huggingface_txt(tok))
        return "tokenizer.txt"
    (out_dir / "tokenizer.mtok").write_bytes(_pipeline_mtok(tok))
    return "tokenizer.mtok"


def _header(kind: int, tok: Tokenizer, prefix: list[int]) -> bytes:
    """Write the text header MNN reads before the body: special, stop and prefix ids.

    MNN splits the input on the special tokens in list order, so the longest come first
    (``<start_of_turn>`` before any shorter control token it might contain).
    """
    special = [i for i, t in enumerate(tok.token_types) if t in _special_types(tok)]
    special.sort(key=lambda i: -len(tok.tokens[i]))
    stops = stop_ids(tok)
    ids = " ".join(str(i) for i in special + stops + prefix)
    return f"{MAGIC} {kind}\n{len(special)} {len(stops)} {len(prefix)}\n{ids}\n".encode()


def _special_types(tok: Tokenizer) -> tuple[int, ...]:
    """Token types MNN treats as special: matched in raw text, skipped when decoding.

    For SentencePiece vocabularies only control tokens: user-defined ones (Gemma's
    newline and space runs) must survive decoding, so they travel as added tokens instead.
    """
    return (_CONTROL, _USER_DEFINED) if tok.model == "gpt2" else (_CONTROL,)


def _huggingface_txt(tok: Tokenizer) -> bytes:
    for text in (*tok.tokens, *tok.merges):
        if "\n" in text or "\r" in text:
            raise errors.InvalidModel("GGUF tokenizer entry contains a line break")
    body = [f"{len(tok.tokens)} {len(tok.merges)}", *tok.tokens, *tok.merges]
    return _header(HUGGINGFACE, tok, []) + ("\n".join(body) + "\n").encode()


def _pack_str(s: str | bytes, width: str = "<H") -> bytes:
    data = s.encode() if isinstance(s, str) else s
    if len(data) >= 1 << (8 * struct.calcsize(width)):
        raise errors.InvalidModel("GGUF tokenizer entry is too long")
    return struct.pack(width, len(data)) + data


def _pipeline_mtok(tok: Tokenizer) -> bytes:
    """SentencePiece-BPE (Gemma 3) as MNN's PIPELINE tokenizer.

    The pipeline is the one HF's converter builds for Gemma and MNN's exporter writes:
    normalizer Replace(" " -> "▁"), no pre-tokenizer, a BPE model with byte fallback whose
    merges are rebuilt from the SentencePiece scores, decoder Replace("▁" -> " "),
    ByteFallback, Fuse; user-defined pieces become added tokens (matched before the model,
    as SentencePiece and llama.cpp do).
    """
    if len(tok.scores) != len(tok.tokens):
        raise errors.InvalidModel("GGUF SentencePiece tokenizer has no scores")
    prefix = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    out = bytearray(_header(PIPELINE, tok, prefix))
    replace = bytes([_NORM_REPLACE]) + _pack_str(" ") + _pack_str(_SPACE)
    if tok.add_space_prefix:  # llama 2 style: "Hi" is encoded as "▁Hi"
        out += struct.pack("<BI", _NORM_SEQUENCE, 2) + bytes([_NORM_PREPEND]) + _pack_str(_SPACE)
    out += replace
    out += bytes([_PRE_NONE])
    by_string = sorted(range(len(tok.tokens)), key=lambda i: tok.tokens[i].encode())
    merges = _merges_from_scores(tok)
    out += struct.pack("<BIBBI", _MODEL_BPE, len(tok.tokens), 1, 0, len(merges))
    for i in by_string:
        out += _pack_str(tok.tokens[i]) + struct.pack("<I", i)
    merges.sort(key=lambda m: (m[0] << 32) | m[1])  # MNN binary-searches (left << 32 | right)
    out += b"".join(struct.pack("<III", *m) for m in merges)
    out += struct.pack("<BI", _DEC_SEQUENCE, 3)
    out += bytes([_DEC_REPLACE]) + _pack_str(_SPACE) + _pack_str(" ")
    out += bytes([_DEC_BYTE_FALLBACK, _DEC_FUSE])
    added = [i for i, t in enumerate(tok.token_types) if t == _USER_DEFINED]
    out += struct.pack("<I", len(added))
    for i in added:
        out += struct.pack("<IBBB", i, 0, 0, 0) + _pack_str(tok.tokens[i])
    out += _pack_str(tok.chat_template or "", "<I")
    out += _pack_str(_token(tok, tok.eos_id))
    out += bytes([0])  # flags: no clean-up of spaces around punctuation
    out += _pack_str(_token(tok, tok.bos_id))
    return bytes(out)


def _token(tok: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tok.tokens[token_id]


def _merges_from_scores(tok: Tokenizer) -> list[tuple[int, int, int]]:
    """Rebuild BPE merges ``(left, right, rank)`` from SentencePiece piece scores.

    SentencePiece BPE repeatedly joins the adjacent pair whose concatenation is the
    highest-scoring normal piece; a rank-based BPE does the same when every split of a
    normal piece into two normal pieces is a merge ranked by the joined piece's score
    (HF's ``SentencePieceExtractor`` does this too). Ties keep vocabulary order.
    """
    normal = {t: i for i, t in enumerate(tok.tokens) if tok.token_types[i] == _NORMAL}
    found: list[tuple[float, int, int, int]] = []
    for piece, pid in normal.items():
        for cut in range(1, len(piece)):
            left, right = normal.get(piece[:cut]), normal.get(piece[cut:])
            if left is not None and right is not None:
                found.append((-tok.scores[pid], pid, left, right))
    found.sort()
    return [(left, right, rank) for rank, (_s, _p, left, right) in enumerate(found)]
