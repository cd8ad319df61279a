"""A small, independent SentencePiece-BPE encoder over a GGUF vocabulary (llama.cpp's way).

It checks `tokenizer_files`' rank-based rebuild from the other side: no merge table, just
"join the adjacent pair whose concatenation is the best-scoring normal piece, leftmost on
ties", with control and user-defined pieces split out of the raw text first and unknown
characters spelled as ``<0xXX>`` byte pieces. Quadratic, fine for test sentences.
"""

from __future__ import annotations

from control_plane.registry.llm.gguf_source import Tokenizer

_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def spm_encode(tok: Tokenizer, text: str) -> list[int]:
    """Encode `text` the way llama.cpp does for a SentencePiece GGUF (special tokens parsed)."""
    normal = {t: i for i, t in enumerate(tok.tokens) if tok.token_types[i] == _NORMAL}
    whole = {
        t: i for i, t in enumerate(tok.tokens) if tok.token_types[i] in (_CONTROL, _USER_DEFINED)
    }
    ids = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    pos, start = 0, 0
    while pos < len(text):
        hit = max((t for t in whole if text.startswith(t, pos)), key=len, default=None)
        if hit is None:
            pos += 1
            continue
        ids += _encode_fragment(tok, normal, text[start:pos])
        ids.append(whole[hit])
        pos = start = pos + len(hit)
    return ids + _encode_fragment(tok, normal, text[start:])


def _encode_fragment(tok: Tokenizer, normal: dict[str, int], text: str) -> list[int]:
    if not text:
        return []
    if tok.add_space_prefix:
        text = " " + text
    symbols = list(text.replace(" ", "\u2581"))
    while True:
        best, best_score = -1, float("-inf")
        for i in range(len(symbols) - 1):
            pid = normal.get(symbols[i] + symbols[i + 1])
            if pid is not None and tok.scores[pid] > best_score:
                best, best_score = i, tok.scores[pid]
        if best < 0:
            break
        symbols[best : best + 2] = [symbols[best] + symbols[best + 1]]
    ids: list[int] = []
    for s in symbols:
        if s in normal:
            ids.append(normal[s])
        else:
            ids += [tok.tokens.index(f"<0x{b:02X}>") for b in s.encode()]
    return ids
