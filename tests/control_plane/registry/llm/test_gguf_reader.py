"""Skiff's GGUF reader reads what gguf's own reader reads, field by field and tensor by
tensor (control_plane.registry.llm.gguf_reader replaces one private helper of it)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from control_plane.demo.third_party_llms import SMOLLM2
from control_plane.registry.llm.gguf_reader import gguf_reader
from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gemma3


def _fields(reader) -> list:
    return [
        (name, f.offset, f.types, f.data, [bytes(np.ascontiguousarray(p)) for p in f.parts])
        for name, f in reader.fields.items()
    ]


def _tensors(reader) -> list:
    return [
        (t.name, t.tensor_type, list(t.shape), int(t.n_elements), t.data_offset, t.data.shape)
        for t in reader.tensors
    ]


@pytest.fixture(params=["tiny", "gemma3-layout", "smollm2"])
def gguf_file(request, tiny_gguf, tmp_path) -> Path:
    if request.param == "tiny":
        return tiny_gguf
    if request.param == "smollm2":  # a real vocabulary: 49,152 tokens and their merges
        return SMOLLM2.part_paths()[0]
    path = tmp_path / "gemma3.gguf"
    write_tiny_gemma3(path)
    return path


def test_every_field_and_tensor_reads_as_ggufs_own_reader_reads_it(gguf_file):
    ours, theirs = gguf_reader(gguf_file), gguf.GGUFReader(gguf_file, "r")
    assert type(ours) is not gguf.GGUFReader  # really the faster one
    assert _fields(ours) == _fields(theirs)
    assert _tensors(ours) == _tensors(theirs)
    assert ours.data_offset == theirs.data_offset and ours.alignment == theirs.alignment
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.data.dtype == b.data.dtype and np.array_equal(
            a.data.view(np.uint8), b.data.view(np.uint8)
        ), a.name
