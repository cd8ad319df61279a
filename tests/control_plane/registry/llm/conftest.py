"""Fixtures for the GGUF converter's tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path
