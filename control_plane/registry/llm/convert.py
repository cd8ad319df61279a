"""Convert a `GgufModel` into an MNN-LLM bundle directory, without torch or ONNX.

Steps: build the graph with MNN.expr (`graph.build_graph`) and save it into a memfd; run MNN's
native converter twice in process (``-f MNN`` at the default level materialises the Attention
jsonop; then ``--optimizeLevel 2 --transformerFuse --saveExternalData`` with the variant's
quantization flags writes ``llm.mnn`` and ``llm.mnn.weight``; either pass alone fails, see
FACTS.md); write ``embeddings_bf16.bin`` (MNN-LLM looks embeddings up from it outside the
graph), the tokenizer file and the two JSON configs.

MNN's Python ``MNN.tools`` wrappers phone home, so the native ``_tools.mnnconvert`` is called
directly, as `control_plane.registry.mnn_worker` does; its hard-coded scratch file is sent to
a memfd. The caller should run this in a throwaway child (`import MNN` prints to stdout, the
converter changes the working directory while it runs, and native code can crash).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from contract import errors
from control_plane.registry.llm.gguf_source import GgufModel
from control_plane.registry.llm.graph import build_graph
from control_plane.registry.llm.tokenizer_files import write_tokenizer

__all__ = ["VARIANTS", "BundleInfo", "convert_gguf"]

BIZ_CODE = "skiff"
_SPILL_NAME = ".__convert_external_data.bin"  # hard-coded in MNN's converter

VARIANTS = ("q4", "q8", "fp16", "fp32")
_EMBED_CHUNK_ROWS = 8192  # rows converted to bf16 at a time: bounds the writer's memory

Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class BundleInfo:
    """What `convert_gguf` wrote."""

    directory: Path
    files: dict[str, int]  # file name -> bytes
    variant: str
    seconds: float

    @property
    def total_bytes(self) -> int:
        """Return the bundle's size: the sum of its files."""
        return sum(self.files.values())


def convert_gguf(
    model: GgufModel,
    out_dir: Path,
    *,
    variant: str = "q4",
    block: int = 32,
    progress: Progress | None = None,
) -> BundleInfo:
    """Write an MNN-LLM bundle for `model` into `out_dir` (created if missing)."""
    if variant not in VARIANTS:
        raise errors.InvalidArgument(f"unknown LLM variant {variant!r} (one of {VARIANTS})")
    if block not in (0, 16, 32, 64, 128, 256) or (block and model.hidden % block):
        raise errors.InvalidArgument(f"quantization block {block} does not divide {model.hidden}")
    start = time.monotonic()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    say = progress or (lambda _stage, _fraction: None)
    tokenizer_name = write_tokenizer(model, out_dir)
    say("tokenizer", 1.0)
    _write_embeddings(model, out_dir / "embeddings_bf16.bin")
    say("embeddings", 1.0)
    _write_graph(model, out_dir, variant, block, say)
    (out_dir / "llm_config.json").write_text(json.dumps(_llm_config(model), indent=2))
    (out_dir / "config.json").write_text(json.dumps(_config(model, tokenizer_name), indent=2))
    files = {p.name: p.stat().st_size for p in sorted(out_dir.iterdir()) if p.is_file()}
    return BundleInfo(out_dir, files, variant, time.monotonic() - start)


def variant_flags(variant: str, block: int) -> list[str]:
    """Return the converter's second-pass flags for one variant."""
    if variant == "q4":
        # Symmetric: on SmolLM2 (block 32) asymmetric int4 agreed with the reference on
        # 0.68-0.73 of the golden positions (mean KL 0.48), symmetric on 0.875 (KL 0.06);
        # HQQ changed nothing. Measured with bench/llm.py's scoring.
        return ["--weightQuantBits", "4", "--weightQuantBlock", str(block)]
    if variant == "q8":
        return ["--weightQuantBits", "8", "--weightQuantBlock", str(block)]
    if variant == "fp16":
        return ["--fp16"]
    return []


def _write_graph(model: GgufModel, out_dir: Path, variant: str, block: int, say: Progress) -> None:
    import _tools  # the native converter, without the MNN.tools wrapper that phones home
    import MNN

    raw = os.memfd_create("skiff-llm-graph", os.MFD_CLOEXEC)
    fused = os.memfd_create("skiff-llm-fused", os.MFD_CLOEXEC)
    try:
        outputs = build_graph(model, lambda i, n: say("graph", i / n))
        MNN.expr.save(outputs, _fd_path(raw))
        del outputs
        release_freed_memory()  # the fp32 constants, before the converter loads its copy
        say("saved", 1.0)
        with _private_cwd():
            _tools.mnnconvert(
                [
                    "mnnconvert",
                    "-f",
                    "MNN",
                    "--modelFile",
                    _fd_path(raw),
                    "--MNNModel",
                    _fd_path(fused),
                    "--bizCode",
                    BIZ_CODE,
                ]
            )
            os.ftruncate(raw, 0)  # free the fp32 graph before the second pass
            release_freed_memory()
            if os.fstat(fused).st_size == 0:
                raise errors.InvalidModel("MNN's converter could not materialise the graph")
            say("convert", 0.5)
            target = out_dir / "llm.mnn"
            _tools.mnnconvert(
                [
                    "mnnconvert",
                    "-f",
                    "MNN",
                    "--modelFile",
                    _fd_path(fused),
                    "--MNNModel",
                    os.path.abspath(target),  # not resolve(): it may be a memfd symlink
                    "--bizCode",
                    BIZ_CODE,
                    "--optimizeLevel",
                    "2",
                    "--transformerFuse",
                    "--saveExternalData",
                    *variant_flags(variant, block),
                ]
            )
        weight = out_dir / "llm.mnn.weight"
        if not target.exists() or not weight.exists() or weight.stat().st_size == 0:
            raise errors.InvalidModel("MNN's converter wrote no llm.mnn/llm.mnn.weight")
        say("convert", 1.0)
    finally:
        os.close(raw)
        os.close(fused)


def release_freed_memory() -> None:
    """Hand memory freed by Python and MNN back to the system (glibc keeps it otherwise).

    The converter then starts from a small resident set instead of stacking its own copy
    of the weights on top of the graph's freed, but still resident, fp32 constants.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _fd_path(fd: int) -> str:
    return f"/proc/self/fd/{fd}"


@contextlib.contextmanager
def _private_cwd() -> Iterator[None]:
    """Run the converter in a private directory whose scratch file is a memfd.

    MNN's optimiser writes every weight to ``.__convert_external_data.bin`` in the working
    directory and reads it back; a symlink of that name to a memfd keeps those bytes off
    disk (see `control_plane.registry.mnn_worker._spill_to_memfd`).
    """
    before = os.getcwd()
    spill = os.memfd_create("skiff-llm-spill", os.MFD_CLOEXEC)
    with tempfile.TemporaryDirectory(prefix="skiff-llm-") as scratch:
        os.symlink(_fd_path(spill), os.path.join(scratch, _SPILL_NAME))
        os.chdir(scratch)
        try:
            yield
        finally:
            os.chdir(before)
            os.close(spill)


def _write_embeddings(model: GgufModel, path: Path) -> None:
    """Write the token embeddings as raw bf16 rows (round to nearest even)."""
    with open(path, "wb") as f:
        for lo in range(0, model.vocab, _EMBED_CHUNK_ROWS):
            rows = model.rows("token_embd.weight", lo, min(model.vocab, lo + _EMBED_CHUNK_ROWS))
            f.write(_to_bf16(rows).tobytes())


def _to_bf16(x: np.ndarray) -> np.ndarray:
    bits = np.ascontiguousarray(x, np.float32).view(np.uint32)
    rounded = bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
    return (rounded >> np.uint32(16)).astype(np.uint16)


def _llm_config(model: GgufModel) -> dict[str, Any]:
    gemma = model.arch == "gemma3"
    config: dict[str, Any] = {
        "model_type": model.arch,
        "hidden_size": model.hidden,
        "layer_nums": model.n_layers,
        "attention_mask": "float",
        "attention_type": "mix" if gemma else "full",
        "key_value_shape": [2, 1, 0, model.kv_heads, model.head_dim],
        "is_visual": False,
    }
    if gemma:
        config["sliding_window"] = model.sliding_window
    tok = model.tokenizer
    if tok.chat_template:
        jinja: dict[str, Any] = {"chat_template": tok.chat_template}
        if tok.bos_id is not None:
            jinja["bos"] = tok.tokens[tok.bos_id]
        if tok.eos_id is not None:
            jinja["eos"] = tok.tokens[tok.eos_id]
        config["jinja"] = jinja
    return config


def _config(model: GgufModel, tokenizer_name: str) -> dict[str, Any]:
    return {
        "llm_model": "llm.mnn",
        "llm_weight": "llm.mnn.weight",
        "embedding_file": "embeddings_bf16.bin",
        "tokenizer_file": tokenizer_name,
        "backend_type": "cpu",
        "thread_num": 2,
        "precision": "normal" if model.arch == "gemma3" else "low",
        "memory": "low",
        "sampler_type": "greedy",
    }
