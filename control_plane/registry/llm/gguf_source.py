"""Open a GGUF language model safely and describe it as a typed `GgufModel`.

A GGUF file is untrusted input: its header declares counts (tensors, metadata entries, array
lengths, string lengths) that a naive reader trusts and loops over or allocates for. So the
header is walked here first with bounds checks against module constants and the real file
size, before `gguf.GGUFReader` (which memory-maps the file and trusts the header) ever sees
it. Only then are hyperparameters read and checked against the tensors the model needs.

Tensors stay in the memory map and are dequantized to fp32 one at a time, on demand
(`GgufModel.tensor`), so the peak memory of a consumer is one tensor plus what it keeps.

llama.cpp's converter permutes the rows of llama's q/k projections so that its interleaved
RoPE matches HF's rotate-half RoPE; `tensor` undoes that for the ``llama`` architecture, so
every consumer sees HF-layout weights and applies rotate-half RoPE. Gemma 3 and Qwen2 are
stored unpermuted (NeoX RoPE).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from contract import errors

__all__ = [
    "MAX_ARRAY_LEN",
    "MAX_KV_COUNT",
    "MAX_LAYERS",
    "MAX_STRING_BYTES",
    "MAX_TENSOR_COUNT",
    "MAX_TENSOR_ELEMENTS",
    "MAX_VOCAB",
    "SUPPORTED_ARCHITECTURES",
    "GgufModel",
    "Tokenizer",
    "open_gguf",
]

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "gemma3")

MAX_TENSOR_COUNT = 4096  # a 100-layer model with 12 tensors a layer is ~1,200
MAX_KV_COUNT = 1024  # real files carry 30-60 metadata entries
MAX_ARRAY_LEN = 1 << 20  # vocabularies and merge lists: 262k tokens for Gemma 3
MAX_STRING_BYTES = 1 << 20  # one key, token or chat template
MAX_TENSOR_ELEMENTS = 1 << 31  # one tensor; Gemma 3's embedding is 168M elements
MAX_LAYERS = 256
MAX_VOCAB = 1 << 19
MAX_METADATA_ITEMS = 3 * MAX_VOCAB  # all arrays together (Gemma 3: 786k)
MAX_HIDDEN = 1 << 14
MAX_CONTEXT = 1 << 22

_DEQUANT_CHUNK_ELEMENTS = 1 << 20  # bounds the dequantizers' temporaries to tens of MB
_MAGIC = b"GGUF"
_ALIGNMENT_DEFAULT = 32
# GGUF value types: fixed sizes of the scalar ones; 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class Tokenizer:
    """The tokenizer as GGUF stores it: data only, never executed or rendered."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece-style, scores)
    tokens: list[str]
    token_types: list[int]  # 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
    merges: list[str]  # "a b" pairs, gpt2 only
    scores: list[float]  # llama only
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    pre: str
    chat_template: str | None  # Jinja source as data; Skiff never renders it
    add_space_prefix: bool = False  # SentencePiece: "Hi" is encoded as "▁Hi"


@dataclass
class GgufModel:
    """A validated GGUF language model: hyperparameters plus lazily dequantized tensors."""

    arch: str
    n_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    rope_base: float
    rope_base_local: float  # gemma3's sliding-window layers; equals rope_base otherwise
    rms_eps: float
    context_length: int
    sliding_window: int  # 0 when every layer attends to everything
    tied_embeddings: bool
    tokenizer: Tokenizer
    name: str = ""
    _reader: Any = field(default=None, repr=False)
    _tensors: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def has_qkv_bias(self) -> bool:
        """True when the attention projections carry biases (Qwen2 style)."""
        return "blk.0.attn_q.bias" in self._tensors

    def is_sliding(self, layer: int) -> bool:
        """Tell whether `layer` is one of gemma3's local layers (every sixth one is global)."""
        return self.arch == "gemma3" and (layer + 1) % 6 != 0

    def has(self, name: str) -> bool:
        """Tell whether the file holds a tensor of this name."""
        return name in self._tensors

    def tensor(self, name: str) -> np.ndarray:
        """Dequantize one tensor to fp32 in [out, in] (torch Linear) layout."""
        t = self._tensor(name)
        shape = tuple(int(d) for d in reversed(t.shape))
        out = np.empty(shape, np.float32)
        self._dequantize_into(t, out, 0)
        if self.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = self.heads if "attn_q" in name else self.kv_heads
            out = _unpermute(out, heads)
        elif self.arch == "llama" and name.endswith(("attn_q.bias", "attn_k.bias")):
            heads = self.heads if "attn_q" in name else self.kv_heads
            out = _unpermute(out[:, None], heads)[:, 0]
        return out

    def rows(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Dequantize rows [lo, hi) of a 2-D tensor (embeddings), without the whole tensor."""
        t = self._tensor(name)
        shape = tuple(int(d) for d in reversed(t.shape))
        if len(shape) != 2 or not 0 <= lo <= hi <= shape[0]:
            raise errors.InvalidArgument(f"rows {lo}:{hi} of GGUF tensor {name!r} {shape}")
        out = np.empty((hi - lo, shape[1]), np.float32)
        self._dequantize_into(t, out, lo)
        return out

    def _tensor(self, name: str) -> Any:
        try:
            return self._tensors[name]
        except KeyError:
            raise errors.InvalidModel(f"GGUF has no tensor {name!r}") from None

    @staticmethod
    def _dequantize_into(t: Any, out: np.ndarray, lo: int) -> None:
        """Fill `out` with rows lo.. of `t`, a few MB at a time.

        gguf's dequantizers make several fp32-sized temporaries; done for a whole 262k-row
        embedding at once they cost gigabytes, done by chunks they cost megabytes.
        """
        import gguf

        data = t.data
        if out.ndim < 2 or data.ndim != out.ndim or data.shape[0] < lo + out.shape[0]:
            whole = gguf.quants.dequantize(data, t.tensor_type).reshape(-1)
            out.reshape(-1)[:] = whole[lo * out[0].size : lo * out[0].size + out.size]
            return
        step = max(1, _DEQUANT_CHUNK_ELEMENTS // max(1, out[0].size))
        for a in range(0, out.shape[0], step):
            b = min(out.shape[0], a + step)
            chunk = gguf.quants.dequantize(data[lo + a : lo + b], t.tensor_type)
            out[a:b] = chunk.reshape(out[a:b].shape)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows (interleaved pairs back to rotate-half)."""
    rows = w.shape[0]
    return np.ascontiguousarray(
        w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


def open_gguf(path: str | os.PathLike[str]) -> GgufModel:
    """Validate and open the GGUF at `path` (a file or a ``/proc/self/fd/N`` memfd path).

    Raises errors.InvalidModel for anything that is not a well-formed, supported model.
    """
    from control_plane.registry.llm.gguf_reader import gguf_reader

    path = os.fspath(path)
    size = os.stat(path).st_size
    with open(path, "rb") as f:
        _check_header(f, size)
    try:
        reader = gguf_reader(path)
    except Exception as exc:  # noqa: BLE001 - gguf raises ValueError, IndexError, ...
        raise errors.InvalidModel(f"not a readable GGUF file ({type(exc).__name__})") from None
    tensors = {t.name: t for t in reader.tensors}
    _check_tensor_data(reader, size)
    fields = {k: _value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    model = _build(fields, tensors, reader)
    # The reader keeps a few numpy views per vocabulary entry: ~500 MB for Gemma 3's 262k
    # tokens, all copied into `fields` by now. Only the tensors' views are still needed.
    reader.fields.clear()
    return model


def _check_header(f: Any, size: int) -> None:
    """Walk the header with bounds checks; refuse before anything trusts its counts."""
    pos = _Cursor(f, size)
    if pos.read(4) != _MAGIC:
        raise errors.InvalidModel("not a GGUF file (bad magic)")
    version = pos.u32()
    if version not in (2, 3):
        raise errors.InvalidModel(f"GGUF version {version} is not supported")
    n_tensors, n_kv = pos.u64(), pos.u64()
    if n_tensors > MAX_TENSOR_COUNT:
        raise errors.InvalidModel(f"GGUF declares {n_tensors} tensors (limit {MAX_TENSOR_COUNT})")
    if n_kv > MAX_KV_COUNT:
        raise errors.InvalidModel(f"GGUF declares {n_kv} metadata entries (limit {MAX_KV_COUNT})")
    items = 0
    for _ in range(n_kv):
        pos.string()
        vtype = pos.u32()
        if vtype == _ARRAY:
            etype, count = pos.u32(), pos.u64()
            if count > MAX_ARRAY_LEN:
                raise errors.InvalidModel(f"GGUF metadata array of {count} items is too long")
            # Tokens, their scores and types, and merges: a few arrays of a vocabulary's
            # length. More (a million empty strings in many arrays) is only there to make
            # the reader spend minutes and gigabytes.
            items += count
            if items > MAX_METADATA_ITEMS:
                raise errors.InvalidModel(
                    f"GGUF metadata arrays hold over {MAX_METADATA_ITEMS:,} items in all"
                )
            if etype == _STRING:
                for _ in range(count):
                    pos.string()
            elif etype in _SCALAR_SIZES:
                pos.skip(_SCALAR_SIZES[etype] * count)
            else:
                raise errors.InvalidModel(f"GGUF metadata array of unsupported type {etype}")
        else:
            pos.value(vtype)
    end = 0
    for _ in range(n_tensors):
        pos.string()
        n_dims = pos.u32()
        if not 1 <= n_dims <= 4:
            raise errors.InvalidModel(f"GGUF tensor with {n_dims} dimensions")
        dims = [pos.u64() for _ in range(n_dims)]
        if any(d == 0 for d in dims) or int(np.prod(dims, dtype=object)) > MAX_TENSOR_ELEMENTS:
            raise errors.InvalidModel(f"GGUF tensor of absurd shape {dims}")
        end = max(end, _tensor_end(pos.u32(), pos.u64(), dims))
    data_start = -(-pos.offset // _ALIGNMENT_DEFAULT) * _ALIGNMENT_DEFAULT
    if data_start + end > size:
        raise errors.InvalidModel("GGUF is truncated (tensor data runs past the end)")


def _tensor_end(qtype: int, offset: int, dims: list[int]) -> int:
    """Where one tensor's bytes end, relative to the data section."""
    import gguf

    try:
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(qtype)]
    except (ValueError, KeyError):
        raise errors.InvalidModel(f"GGUF tensor of unknown type {qtype}") from None
    return offset + int(np.prod(dims, dtype=object)) // block * type_size


def _check_tensor_data(reader: Any, size: int) -> None:
    """Refuse tensors whose bytes run past the end of the file (a truncated download)."""
    import gguf

    for t in reader.tensors:
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        need = int(t.n_elements) // block * type_size
        if t.data_offset + need > size or t.data.nbytes != need:
            raise errors.InvalidModel(f"GGUF is truncated (tensor {t.name!r} is incomplete)")


class _Cursor:
    """Sequential reads from the header that never go past the end of the file."""

    def __init__(self, f: Any, size: int) -> None:
        self._f, self._size, self._pos = f, size, 0

    @property
    def offset(self) -> int:
        return self._pos

    def read(self, n: int) -> bytes:
        if self._pos + n > self._size:
            raise errors.InvalidModel("GGUF is truncated (header runs past the end)")
        self._pos += n
        data = self._f.read(n)
        if len(data) != n:
            raise errors.InvalidModel("GGUF is truncated (header runs past the end)")
        return data

    def skip(self, n: int) -> None:
        if self._pos + n > self._size:
            raise errors.InvalidModel("GGUF is truncated (header runs past the end)")
        self._pos += n
        self._f.seek(self._pos)

    def u32(self) -> int:
        return int(struct.unpack("<I", self.read(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.read(8))[0])

    def string(self) -> None:
        n = self.u64()
        if n > MAX_STRING_BYTES:
            raise errors.InvalidModel(f"GGUF string of {n} bytes is too long")
        self.skip(n)

    def value(self, vtype: int) -> None:
        if vtype == _STRING:
            self.string()
        elif vtype in _SCALAR_SIZES:
            self.skip(_SCALAR_SIZES[vtype])
        else:
            raise errors.InvalidModel(f"GGUF metadata of unsupported type {vtype}")


def _value(f: Any) -> Any:
    """One metadata field as a plain Python value (strings decoded, arrays as lists)."""
    try:
        return f.contents()
    except Exception:  # noqa: BLE001 - undecodable strings and the like
        return None


def _build(fields: dict[str, Any], tensors: dict[str, Any], reader: Any) -> GgufModel:
    """Read and check the hyperparameters the forward pass and converter rely on."""
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise errors.InvalidModel(
            f"GGUF architecture {arch!r} is not supported (llama family, gemma3)"
        )

    def num(key: str, default: Any = None, *, lo: float = 1, hi: float = MAX_HIDDEN) -> Any:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise errors.InvalidModel(f"GGUF lacks {arch}.{key}")
        if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
            raise errors.InvalidModel(f"GGUF {arch}.{key} = {value!r:.40} is out of range")
        return value

    hidden = int(num("embedding_length"))
    heads = int(num("attention.head_count", hi=1024))
    kv_heads = int(num("attention.head_count_kv", heads, hi=heads))
    head_dim = int(num("attention.key_length", hidden // heads, hi=1024))
    if heads % kv_heads or (arch != "gemma3" and head_dim * heads != hidden):
        raise errors.InvalidModel(f"GGUF heads {heads}/{kv_heads} do not fit hidden {hidden}")
    if arch == "llama" and head_dim % 2:
        raise errors.InvalidModel(f"GGUF head size {head_dim} is odd")
    tok = _tokenizer(fields)
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise errors.InvalidModel("GGUF has no tensor 'token_embd.weight'")
    vocab = int(embd.shape[1])
    if not 1 <= vocab <= MAX_VOCAB or int(embd.shape[0]) != hidden:
        raise errors.InvalidModel(f"GGUF embedding shape {list(embd.shape)} is unusable")
    if len(tok.tokens) > vocab:
        raise errors.InvalidModel(f"GGUF has {len(tok.tokens)} tokens for {vocab} embeddings")
    base = float(num("rope.freq_base", 10000.0, lo=1.0, hi=1e9))
    model = GgufModel(
        arch=arch,
        n_layers=int(num("block_count", hi=MAX_LAYERS)),
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=int(num("feed_forward_length", hi=1 << 17)),
        vocab=vocab,
        rope_base=base,
        rope_base_local=10000.0 if arch == "gemma3" else base,
        rms_eps=float(num("attention.layer_norm_rms_epsilon", 1e-6, lo=0.0, hi=1.0)),
        context_length=int(num("context_length", 2048, hi=MAX_CONTEXT)),
        sliding_window=int(num("attention.sliding_window", 512, hi=MAX_CONTEXT))
        if arch == "gemma3"
        else 0,
        tied_embeddings="output.weight" not in tensors,
        tokenizer=tok,
        name=str(fields.get("general.name") or ""),
        _reader=reader,
        _tensors=tensors,
    )
    _check_tensors(model)
    return model


def _tokenizer(fields: dict[str, Any]) -> Tokenizer:
    kind = fields.get("tokenizer.ggml.model")
    if kind not in ("gpt2", "llama"):
        raise errors.InvalidModel(f"GGUF tokenizer {kind!r} is not supported (gpt2, llama)")
    tokens = fields.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise errors.InvalidModel("GGUF has no tokenizer vocabulary")
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = fields.get("tokenizer.ggml.scores") or []
    merges = fields.get("tokenizer.ggml.merges") or []
    if len(types) != len(tokens) or (scores and len(scores) != len(tokens)):
        raise errors.InvalidModel("GGUF tokenizer arrays disagree in length")
    if kind == "gpt2" and not merges:
        raise errors.InvalidModel("GGUF gpt2 tokenizer has no merges")

    def token_id(key: str) -> int | None:
        value = fields.get(key)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < len(tokens):
            raise errors.InvalidModel(f"GGUF {key} = {value!r:.40} is not a token")
        return int(value)

    template = fields.get("tokenizer.chat_template")
    return Tokenizer(
        model=kind,
        tokens=[str(t) for t in tokens],
        token_types=[int(t) for t in types],
        merges=[str(m) for m in merges],
        scores=[float(s) for s in scores],
        bos_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_id=token_id("tokenizer.ggml.eos_token_id"),
        add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", kind == "llama")),
        pre=str(fields.get("tokenizer.ggml.pre") or ""),
        chat_template=template if isinstance(template, str) else None,
        # llama.cpp's default for SentencePiece vocabularies that do not say
        add_space_prefix=bool(fields.get("tokenizer.ggml.add_space_prefix", kind == "llama")),
    )


def _layer_tensors(model: GgufModel) -> dict[str, tuple[int, ...]]:
    """List the tensors every layer needs, with their [out, in] shapes."""
    h, q, kv, f = (
        model.hidden,
        model.heads * model.head_dim,
        model.kv_heads * model.head_dim,
        model.ffn,
    )
    need = {
        "attn_norm.weight": (h,),
        "attn_q.weight": (q, h),
        "attn_k.weight": (kv, h),
        "attn_v.weight": (kv, h),
        "attn_output.weight": (h, q),
        "ffn_norm.weight": (h,),
        "ffn_gate.weight": (f, h),
        "ffn_up.weight": (f, h),
        "ffn_down.weight": (h, f),
    }
    if model.arch == "gemma3":
        need |= {
            "attn_q_norm.weight": (model.head_dim,),
            "attn_k_norm.weight": (model.head_dim,),
            "post_attention_norm.weight": (h,),
            "post_ffw_norm.weight": (h,),
        }
    return need


def _check_tensors(model: GgufModel) -> None:
    """Refuse a model missing a tensor the forward pass needs, or with a wrong shape."""
    need = {"output_norm.weight": (model.hidden,)}
    if not model.tied_embeddings:
        need["output.weight"] = (model.vocab, model.hidden)
    for i in range(model.n_layers):
        need |= {f"blk.{i}.{k}": v for k, v in _layer_tensors(model).items()}
    for name, shape in need.items():
        t = model._tensors.get(name)
        if t is None:
            raise errors.InvalidModel(f"GGUF has no tensor {name!r}")
        got = tuple(int(d) for d in reversed(t.shape))
        if got != shape:
            raise errors.InvalidModel(
                f"GGUF tensor {name!r} has shape {list(got)}, not {list(shape)}"
            )
