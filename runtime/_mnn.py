"""The one module that touches MNN: a quiet import, captured native logs, backend detection.

``import MNN`` prints a CPU-feature line to stdout, and MNN's native logging (load errors,
"Can't Find type=3 backend, use 0 instead") is plain printf, invisible to Python's
``sys.stdout``. Apps' stdout must stay clean, so every native call that may log runs
inside `native_output()`, which captures C stdio's stdout for the duration (see
`runtime._stdio`: only what goes through C stdio, never the app's own writes to fd 1)
and forwards what MNN said to the ``runtime.mnn`` logger at DEBUG. Captures are
serialised and kept off the inference fast path.

``MNN.tools`` (the converter wrappers) pip-installs packages and uploads usage data when
imported; an import guard refuses it, and the aliyun SDK it pulls in, in any process
that reaches MNN through this module.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import logging
import re
import sys
import threading
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from runtime._stdio import Captured, capture_c_stdout, line_buffer_c_stdout
from runtime.backends import Backend, BackendConfig
from runtime.errors import ModelLoadError

__all__ = [
    "MNN_DTYPES",
    "Captured",
    "detect_backend",
    "dtype_name",
    "forbidden_loaded",
    "install_import_guard",
    "load_mnn",
    "log_reason",
    "line_buffer_native_stdout",
    "native_output",
    "shape_error",
]

logger = logging.getLogger("runtime.mnn")

FORBIDDEN_MODULES = ("MNN.tools", "aliyun")
SESSION_INFO_BACKENDS = 2  # MNN::Interpreter::SessionInfoCode::BACKENDS
# MNN's own words when it swaps an unavailable backend for another one.
_FALLBACK_LINE = re.compile(r"Can't Find type=(\d+) backend, use (\d+) instead")
_REASON_MARKERS = ("Error", "error", "Invalid", "Not Support", "Can't", "failed")
# What MNN prints when it cannot resize a graph to the inputs' shapes (seen with MNN 3.x:
# "Reshape error: 17 -> 16", "Broad cast error, dim1 = 3, dim2 = 2", then "Compute Shape
# Error for <op>" and "code=3 in onForward"; 3 is COMPUTE_SIZE_ERROR in MNN's ErrorCode).
_SHAPE_ERROR = re.compile(r"Compute Shape Error|Reshape error|Broad cast error|code=3 in on")

_lock = threading.Lock()  # guards the lazy import
_mnn: ModuleType | None = None
_detected: dict[BackendConfig, tuple[Backend, str]] = {}


# MNN's Var dtypes (printed as "dtype.float") by numpy name.
MNN_DTYPES = {
    "float": "float32",
    "double": "float64",
    "int": "int32",
    "int64": "int64",
    "int8": "int8",
    "uint8": "uint8",
}


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


def log_reason(text: str, *, limit: int = 2) -> str:
    """Pick the first lines of MNN's log that say what went wrong, joined into one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    telling = [line for line in lines if any(m in line for m in _REASON_MARKERS)]
    return "; ".join(telling[:limit] or lines[-1:])


def shape_error(text: str) -> bool:
    """Tell whether MNN's log says it could not fit the graph to the inputs' shapes."""
    return _SHAPE_ERROR.search(text) is not None


def detect_backend(path: str, config: BackendConfig, load_log: str = "") -> tuple[Backend, str]:
    """Return the backend MNN actually runs `config` on, and the evidence for it.

    MNN never fails a request for an unavailable backend: it logs a line and uses the
    CPU. Two independent signals are read, and the CPU wins if either says so:

    1. MNN's own fallback line ("Can't Find type=N backend, use 0 instead") in
       `load_log` (the output captured while the model was loaded with this config);
    2. the backend MNN reports for a session built with the same schedule config
       (``Interpreter.getSessionInfo(session, BACKENDS)``: the main forward type of its
       pipeline), which also works where MNN logs elsewhere (logcat on Android).

    Availability is a property of the device and the MNN build, not of the model, so the
    session check runs once per config per process.
    """
    if config.backend is Backend.CPU:
        return Backend.CPU, "CPU requested; MNN has nothing to fall back from"
    logged = _logged_fallback(load_log, config)
    if logged is not None:
        return logged
    if config not in _detected:
        _detected[config] = _session_backend(path, config)
    return _detected[config]


def _logged_fallback(text: str, config: BackendConfig) -> tuple[Backend, str] | None:
    """Return the backend MNN's fallback line names for `config`, if it printed one."""
    for match in _FALLBACK_LINE.finditer(text):
        if int(match.group(1)) == int(config.backend):
            return Backend.from_forward_type(int(match.group(2))), f"MNN log: {match.group(0)}"
    return None


def _session_backend(path: str, config: BackendConfig) -> tuple[Backend, str]:
    """Build a throwaway MNN session with `config`; return the backend it reports."""
    mnn = load_mnn()
    with native_output() as log:
        try:
            interpreter = mnn.Interpreter(path)
            session = interpreter.createSession(config.mnn_session_config())
            forward_type = int(interpreter.getSessionInfo(session, SESSION_INFO_BACKENDS))
            del session, interpreter  # the interpreter owns the session and its buffers
        except Exception as exc:  # noqa: BLE001 - the binding raises bare Exception
            error: Exception | None = exc
        else:
            error = None
    if error is not None:
        reason = log_reason(log.text) or str(error)
        raise ModelLoadError(f"MNN cannot load the model with {config.key}: {reason}")
    try:
        reported = Backend.from_forward_type(forward_type)
    except ValueError:
        raise ModelLoadError(f"MNN reports an unknown backend type {forward_type}") from None
    evidence = f"MNN session reports forward type {forward_type} ({reported.name})"
    logged = _logged_fallback(log.text, config)
    if logged is None:
        return reported, evidence
    # Both signals present: only name the requested backend if both say so.
    actual = reported if reported is not config.backend else logged[0]
    return actual, f"{logged[1]}; {evidence}"


def line_buffer_native_stdout() -> None:
    """Make C stdout line-buffered (see `runtime._stdio.line_buffer_c_stdout`)."""
    line_buffer_c_stdout()
