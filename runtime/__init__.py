"""Skiff's on-device runtime: run MNN models and process event streams.

The public API is what this module exports. `Model` loads a decrypted `.mnn` model from
bytes (never writing plaintext to disk), picks the fastest backend config whose outputs
match the model's golden data, falls back along a chain on failure, and can run MNN in a
worker process so a native crash is contained. `ModelSlot` hot-swaps versions under
load. `StreamEngine` turns raw device events into model inputs (native C++ core); its
state survives restarts through `snapshot()`/`restore()`. `runtime.mnn_host` holds what
any process hosting MNN needs (the quiet, guarded import; models as sealed memfds).

Importing this package loads nothing but this file: each name is imported from its module
on first use (PEP 562). Processes that need one corner of the runtime (the registry's
sandboxed MNN child, the control plane reading the histogram layout, a worker process)
then pay for that corner only, never for numpy, MNN or the native stream engine they do
not use.
"""

from __future__ import annotations

import importlib

# Not typing.TYPE_CHECKING: importing typing (and the re module it pulls in) would cost
# more than the rest of this file. Type checkers treat a local TYPE_CHECKING alike.
TYPE_CHECKING = False
if TYPE_CHECKING:  # what type checkers and editors see; _EXPORTS is what runs
    from runtime.backends import Backend, BackendConfig, MemoryMode, Precision, candidate_configs
    from runtime.errors import (
        BackendUnavailable,
        DeadlineExceeded,
        InferenceError,
        InvalidInput,
        ModelFailed,
        ModelLoadError,
        RuntimeFailure,
        StaleSwap,
        UnsupportedPlatform,
        WorkerCrashed,
    )
    from runtime.events import CrashEvent, FallbackEvent
    from runtime.golden import Golden, Tolerance
    from runtime.histogram import LatencyHistogram
    from runtime.model import Isolation, Model
    from runtime.probe import ProbeResult
    from runtime.signature import Signature, TensorSpec
    from runtime.stream import StreamEngine
    from runtime.stream_batch import Firings
    from runtime.stream_spec import (
        BatchFormatError,
        Feature,
        PatternError,
        SnapshotError,
        SnapshotMismatchError,
        StreamInputError,
        count,
        sliding,
        tumbling,
    )
    from runtime.swap import ModelSlot
    from runtime.worker import prewarm_worker

# Public name -> the module defining it. Stream errors and feature builders come from
# `stream_spec`, not `stream`, so catching or declaring them never loads the C++ core.
_EXPORTS = {
    "Backend": "runtime.backends",
    "BackendConfig": "runtime.backends",
    "MemoryMode": "runtime.backends",
    "Precision": "runtime.backends",
    "candidate_configs": "runtime.backends",
    "BackendUnavailable": "runtime.errors",
    "DeadlineExceeded": "runtime.errors",
    "InferenceError": "runtime.errors",
    "InvalidInput": "runtime.errors",
    "ModelFailed": "runtime.errors",
    "ModelLoadError": "runtime.errors",
    "RuntimeFailure": "runtime.errors",
    "StaleSwap": "runtime.errors",
    "UnsupportedPlatform": "runtime.errors",
    "WorkerCrashed": "runtime.errors",
    "CrashEvent": "runtime.events",
    "FallbackEvent": "runtime.events",
    "Golden": "runtime.golden",
    "Tolerance": "runtime.golden",
    "LatencyHistogram": "runtime.histogram",
    "Isolation": "runtime.model",
    "Model": "runtime.model",
    "ProbeResult": "runtime.probe",
    "Signature": "runtime.signature",
    "TensorSpec": "runtime.signature",
    "StreamEngine": "runtime.stream",
    "Firings": "runtime.stream_batch",
    "BatchFormatError": "runtime.stream_spec",
    "Feature": "runtime.stream_spec",
    "PatternError": "runtime.stream_spec",
    "SnapshotError": "runtime.stream_spec",
    "SnapshotMismatchError": "runtime.stream_spec",
    "StreamInputError": "runtime.stream_spec",
    "count": "runtime.stream_spec",
    "sliding": "runtime.stream_spec",
    "tumbling": "runtime.stream_spec",
    "ModelSlot": "runtime.swap",
    "prewarm_worker": "runtime.worker",
}

__all__ = [
    "Backend",
    "BackendConfig",
    "BackendUnavailable",
    "BatchFormatError",
    "CrashEvent",
    "DeadlineExceeded",
    "FallbackEvent",
    "Feature",
    "Firings",
    "Golden",
    "InferenceError",
    "InvalidInput",
    "Isolation",
    "LatencyHistogram",
    "MemoryMode",
    "Model",
    "ModelFailed",
    "ModelLoadError",
    "ModelSlot",
    "PatternError",
    "Precision",
    "ProbeResult",
    "RuntimeFailure",
    "Signature",
    "SnapshotError",
    "SnapshotMismatchError",
    "StaleSwap",
    "StreamEngine",
    "StreamInputError",
    "TensorSpec",
    "Tolerance",
    "UnsupportedPlatform",
    "WorkerCrashed",
    "candidate_configs",
    "count",
    "prewarm_worker",
    "sliding",
    "tumbling",
]


def __getattr__(name: str) -> object:
    """Import a public name from its module on first use, then keep it here."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    """List the public names too, though they are not imported yet."""
    return sorted({*globals(), *__all__})
