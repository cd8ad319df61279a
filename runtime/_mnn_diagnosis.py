"""What MNN's logs and sessions say happened: why a load failed, which backend really runs.

The runtime's own reading of MNN (the registry's child does not need it): the first
telling lines of a failed load, whether a failure means the inputs' shapes did not fit
the graph, and which backend MNN actually chose for a requested config. MNN is reached
through `runtime.mnn_host`, so it loads quietly and behind the import guard.
"""

from __future__ import annotations

import re

import runtime.mnn_host as mnn_host
from runtime.backends import Backend, BackendConfig
from runtime.errors import ModelLoadError

__all__ = ["detect_backend", "log_reason", "shape_error"]

SESSION_INFO_BACKENDS = 2  # MNN::Interpreter::SessionInfoCode::BACKENDS
# MNN's own words when it swaps an unavailable backend for another one.
_FALLBACK_LINE = re.compile(r"Can't Find type=(\d+) backend, use (\d+) instead")
_REASON_MARKERS = ("Error", "error", "Invalid", "Not Support", "Can't", "failed")
# What MNN prints when it cannot resize a graph to the inputs' shapes (seen with MNN 3.x:
# "Reshape error: 17 -> 16", "Broad cast error, dim1 = 3, dim2 = 2", then "Compute Shape
# Error for <op>" and "code=3 in onForward"; 3 is COMPUTE_SIZE_ERROR in MNN's ErrorCode).
_SHAPE_ERROR = re.compile(r"Compute Shape Error|Reshape error|Broad cast error|code=3 in on")

_detected: dict[BackendConfig, tuple[Backend, str]] = {}


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
    mnn = mnn_host.load_mnn()
    with mnn_host.native_output() as log:
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
