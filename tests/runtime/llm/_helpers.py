"""Synthetic bundles and tars for the bundle tests (no model needed)."""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Mapping

TOKENIZER_TXT = b"430 3\n1 1 0\n0 2\nAA==\n"


def bundle_files(**changes: bytes | None) -> dict[str, bytes]:
    """A minimal valid bundle's files; a keyword replaces one (None removes it)."""
    files: dict[str, bytes | None] = {
        "config.json": json.dumps(
            {"llm_model": "llm.mnn", "llm_weight": "llm.mnn.weight"}
        ).encode(),
        "llm_config.json": json.dumps(
            {"hidden_size": 8, "layer_nums": 2, "jinja": {"chat_template": "{{ x }}"}}
        ).encode(),
        "llm.mnn": b"graph",
        "llm.mnn.weight": b"weights",
        "tokenizer.txt": TOKENIZER_TXT,
        "embeddings_bf16.bin": b"\0" * 32,
    }
    files.update({k.replace("__", "."): v for k, v in changes.items()})
    return {k: v for k, v in files.items() if v is not None}


def tar_bytes(members: Mapping[str, bytes], *, prefix: str = "") -> bytes:
    """An uncompressed tar of regular files, in the given order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def tar_with(
    extra: tarfile.TarInfo, data: bytes = b"", base: Mapping[str, bytes] | None = None
) -> bytes:
    """A valid bundle tar plus one hand-made member."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, blob in (base if base is not None else bundle_files()).items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
        extra.size = len(data) if extra.isreg() else 0
        tar.addfile(extra, io.BytesIO(data) if extra.isreg() else None)
    return out.getvalue()


def memfds(files: Mapping[str, bytes]) -> dict[str, int]:
    """Each file in its own memfd (unsealed: tests only)."""
    fds = {}
    for name, data in files.items():
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.write(fd, data)
        fds[name] = fd
    return fds
