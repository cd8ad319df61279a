"""What any process that hosts MNN needs: a guarded, quiet import and models in RAM only.

Two kinds of process load MNN: the runtime (in the app, or in its worker process) and the
registry's sandboxed child that inspects and converts uploads. Both must keep the same
promises, so they share this module rather than each keeping its own copy.

Quiet: ``import MNN`` prints a CPU-feature line to stdout, and MNN's native logging (load
errors, "Can't Find type=3 backend, use 0 instead") is plain printf, invisible to Python's
``sys.stdout``. Apps' stdout must stay clean, so every native call that may log runs
inside `native_output()`, which captures C stdio's stdout for the duration (only what goes
through C stdio, never the app's own writes to fd 1) and forwards what MNN said to the
``runtime.mnn`` logger at DEBUG.

Guarded: ``MNN.tools`` (the converter wrappers) pip-installs packages and uploads usage
data when imported; `install_import_guard()` refuses it, and the aliyun SDK it pulls in,
in any process that calls it (`load_mnn()` always does).

In RAM only: MNN's Python API loads models from a path, never from bytes. A memfd is an
anonymous RAM-backed file, reachable as ``/proc/self/fd/N`` (and, once inherited, from a
child process the same way), so decrypted weights never touch a filesystem. The memfd is
sealed after writing: nothing (not even a compromised worker sharing it) can change or
truncate the model that later loads and restarts read. A process holding plaintext calls
`runtime.hardening.forbid_core_dumps()` so a crash cannot write it to disk either.

Importing this module loads neither MNN nor numpy.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.abc
import logging
import os
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from runtime._stdio import Captured, capture_c_stdout, line_buffer_c_stdout, memfd
from runtime.errors import UnsupportedPlatform

__all__ = [
    "FORBIDDEN_MODULES",
    "MNN_DTYPES",
    "Captured",
    "dtype_name",
    "fd_path",
    "forbidden_loaded",
    "install_import_guard",
    "is_forbidden",
    "line_buffer_native_stdout",
    "load_mnn",
    "native_output",
    "sealed_memfd",
]

logger = logging.getLogger("runtime.mnn")

FORBIDDEN_MODULES = ("MNN.tools", "aliyun")
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE

_lock = threading.Lock()  # guards the lazy import
_mnn: ModuleType | None = None

# MNN's Var dtypes (printed as "dtype.float") by numpy name.
MNN_DTYPES = {
    "float": "float32",
    "double": "float64",
    "int": "int32",
    "int64": "int64",
    "int8": "int8",
    "uint8": "uint8",
}


def load_mnn() -> ModuleType:
    """Import MNN once, quietly and with the import guard in place; return the module."""
    global _mnn
    if _mnn is None:
        with _lock:
            if _mnn is None:
                install_import_guard()
                with native_output():
                    import MNN
                _mnn = MNN
    return _mnn


@contextlib.contextmanager
def native_output() -> Iterator[Captured]:
    """Capture MNN's printf logging into memory for the duration of the block."""
    with capture_c_stdout() as captured:
        yield captured
    if captured.text.strip():
        logger.debug("MNN: %s", " | ".join(captured.text.strip().splitlines()))


def line_buffer_native_stdout() -> None:
    """Make C stdout line-buffered, so a native crash loses none of MNN's last lines.

    For processes whose stdout is a log file or pipe (workers, the registry's child);
    call it before anything writes to C stdout.
    """
    line_buffer_c_stdout()


def dtype_name(var: Any, default: str = "unknown") -> str:
    """Map an MNN Var's dtype to a numpy-style name."""
    return MNN_DTYPES.get(str(var.dtype).removeprefix("dtype."), default)


def is_forbidden(name: str) -> bool:
    """Tell whether module `name` is, or lives under, a phone-home package."""
    return any(name == p or name.startswith(p + ".") for p in FORBIDDEN_MODULES)


class _ImportGuard(importlib.abc.MetaPathFinder):
    """Refuse the phone-home modules whatever tries to import them."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        """Raise for forbidden modules; defer to the normal finders for the rest."""
        if is_forbidden(fullname):
            raise ImportError(f"{fullname} is blocked by Skiff (it phones home)")
        return None


def install_import_guard() -> None:
    """Put the guard first on sys.meta_path so it sees every later import."""
    if not any(isinstance(finder, _ImportGuard) for finder in sys.meta_path):
        sys.meta_path.insert(0, _ImportGuard())


def forbidden_loaded() -> list[str]:
    """Return the names of phone-home modules present in sys.modules."""
    return sorted(name for name in sys.modules if is_forbidden(name))


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


def fd_path(fd: int) -> str:
    """Address a descriptor as a path MNN can load; each open gets its own file offset."""
    return f"/proc/self/fd/{fd}"
