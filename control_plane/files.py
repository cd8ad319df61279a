"""Small file primitives shared by the stores, the key files and the memfd code."""

from __future__ import annotations

import os
import tempfile
from contextlib import suppress
from pathlib import Path

from contract import errors


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of `data` to `fd` (os.write may write less than asked)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_private_file(path: Path, data: bytes, *, replace: bool) -> None:
    """Write `data` to `path` atomically with mode 0600 (temp file, fsync, rename).

    With ``replace=False`` the rename is a hard link, which fails if `path` exists,
    so two racing creators cannot overwrite each other's key.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp creates it 0600 whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise errors.AlreadyExists(f"{path} already exists") from None
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_directory(path.parent)  # make the rename itself durable


def fsync_directory(directory: Path) -> None:
    """Make a rename or link inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
