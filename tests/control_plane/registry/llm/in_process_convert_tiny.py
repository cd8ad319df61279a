"""Tiny synthetic model: GGUF -> bundle, MNN-LLM logits against the numpy reference."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from contract import errors
from control_plane.registry.llm.convert import convert_gguf
from control_plane.registry.llm.gguf_source import open_gguf
from control_plane.registry.llm.reference import Reference
from tests.control_plane.registry.llm.spm import spm_encode
from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gemma3, write_tiny_gguf

IDS = [40, 70, 80, 81, 90, 100, 3, 4, 120, 200]


def _bundle_logits(config: Path, ids: list[int]) -> np.ndarray:
    import MNN.llm as llm

    m = llm.create(str(config))
    m.set_config({"precision": "high"})
    m.load()
    rows = []
    for tok in ids:
        a = np.array(m.forward([tok]).read())
        rows.append(a.reshape(-1, a.shape[-1])[-1])
    return np.stack(rows)


@pytest.mark.parametrize("variant", ["fp32", "q8"])
def test_bundle_matches_reference(tiny_gguf: Path, tmp_path: Path, variant: str) -> None:
    model = open_gguf(tiny_gguf)
    info = convert_gguf(model, tmp_path / variant, variant=variant)
    assert {"llm.mnn", "llm.mnn.weight", "tokenizer.txt", "config.json"} <= set(info.files)
    ref = Reference(model).logits(IDS)
    got = _bundle_logits(tmp_path / variant / "config.json", IDS)
    if variant == "fp32":
        # embeddings travel as bf16: ~0.4% relative error on the inputs
        np.testing.assert_allclose(got, ref, atol=0.02 * np.abs(ref).max())
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= (1.0 if variant == "fp32" else 0.8)


def test_tiny_gemma3_tokenizer_and_graph(tmp_path: Path) -> None:
    """The ``.mtok`` tokenizer and the gemma3 graph, past the (8-token) sliding window."""
    path = tmp_path / "gemma3.gguf"
    write_tiny_gemma3(path)
    model = open_gguf(path)
    info = convert_gguf(model, tmp_path / "fp32", variant="fp32")
    assert "tokenizer.mtok" in info.files
    import MNN.llm as llm

    m = llm.create(str(tmp_path / "fp32" / "config.json"))
    m.load()
    for text in ("the cat", "That cat in the\n  hat é ü<start_of_turn>at", " an  ant"):
        assert m.tokenizer_encode(text) == spm_encode(model.tokenizer, text), text
    del m
    ids = spm_encode(model.tokenizer, "the cat sat on the mat in the hat then ran")
    assert len(ids) > 2 * model.sliding_window
    ref = Reference(model).logits(ids)
    got = _bundle_logits(tmp_path / "fp32" / "config.json", ids)
    np.testing.assert_allclose(got, ref, atol=0.02 * np.abs(ref).max())


def test_memfd_path_opens(tiny_gguf: Path) -> None:
    fd = os.memfd_create("gguf")
    try:
        os.write(fd, tiny_gguf.read_bytes())
        assert open_gguf(f"/proc/self/fd/{fd}").n_layers == 2
    finally:
        os.close(fd)


def test_unsupported_architecture_is_named(tmp_path: Path) -> None:
    path = tmp_path / "x.gguf"
    write_tiny_gguf(path, arch="falcon")
    with pytest.raises(errors.InvalidModel, match="'falcon' is not supported"):
        open_gguf(path)


def test_truncated_file_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    for cut in (100, len(data) - 1000):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(errors.InvalidModel, match="truncated"):
            open_gguf(path)


def test_absurd_counts_refused(tiny_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    data[8:16] = (10**12).to_bytes(8, "little")  # tensor count
    path = tmp_path / "absurd.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(errors.InvalidModel, match="tensors"):
        open_gguf(path)


def test_metadata_arrays_past_what_a_vocabulary_needs_are_refused_before_parsing(tmp_path: Path):
    # Two arrays of a million empty strings: 15 MB that made the reader spend 37 s and
    # 3 GB before it found the file wanting. The header walk now refuses it first (the
    # message is the walk's: the reader never ran).
    import struct

    path = tmp_path / "arrays.gguf"
    with path.open("wb") as f:
        f.write(b"GGUF" + struct.pack("<IQQ", 3, 0, 2))
        for key in (b"junk.a", b"junk.b"):
            f.write(struct.pack("<Q", len(key)) + key)
            f.write(struct.pack("<IIQ", 9, 8, 1_000_000))  # array of strings
            f.write(b"\0" * 8 * 1_000_000)  # each of length 0
    with pytest.raises(errors.InvalidModel, match="metadata arrays hold over"):
        open_gguf(path)
