"""Plaintext models in RAM only: a sealed memfd MNN can open by path.

MNN's Python API loads models from a path, never from bytes. A memfd is an anonymous
RAM-backed file, reachable as ``/proc/self/fd/N`` (and, once inherited, from a worker
process the same way), so decrypted weights never touch a filesystem. The memfd is
sealed after writing: nothing (not even a compromised worker sharing it) can change or
truncate the model that later loads and restarts read. A process holding plaintext
calls `runtime.hardening.forbid_core_dumps()` so a crash cannot write it to disk either.
"""

from __future__ import annotations

import fcntl
import os

from runtime.errors import UnsupportedPlatform

__all__ = ["fd_path", "memfd", "sealed_memfd"]

_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


def sealed_memfd(data: bytes | bytearray | memoryview, *, name: str = "skiff-model") -> int:
    """Copy `data` into a new sealed, close-on-exec memfd and return its descriptor.

    The caller owns the descriptor. Raises UnsupportedPlatform where memfd is missing
    (macOS, iOS): there is no way to hand MNN plaintext there without a file.
    """
    if not hasattr(os, "memfd_create"):
        raise UnsupportedPlatform("memfd_create is not available: cannot keep models off disk")
    fd = memfd(name, os.MFD_ALLOW_SEALING)
    try:
        view = memoryview(data).cast("B")
        while view:
            view = view[os.write(fd, view) :]
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def memfd(name: str, flags: int = 0) -> int:
    """Create a close-on-exec memfd numbered 3 or above.

    In a process whose stdin/stdout/stderr are closed (a daemon), a new descriptor can
    be 0, 1 or 2; capturing MNN's stdout (fd 1) would then clobber it.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | flags)
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def fd_path(fd: int) -> str:
    """Address a descriptor as a path; each open of it gets its own file offset."""
    return f"/proc/self/fd/{fd}"
