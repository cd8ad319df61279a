"""Skiff's on-device runtime: run MNN models and process event streams.

The public API is what this module exports. `Model` loads a decrypted `.mnn` model from
bytes (never writing plaintext to disk), picks the fastest backend config whose outputs
match the model's golden data, falls back along a chain on failure, and can run MNN in a
worker process so a native crash is contained. `ModelSlot` hot-swaps versions under
load. `StreamEngine` turns raw device events into model inputs (native C++ core); its
state survives restarts through `snapshot()`/`restore()`.
Importing this package does not load MNN.
"""

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
from runtime.stream import (
    BatchFormatError,
    Feature,
    Firings,
    PatternError,
    SnapshotError,
    SnapshotMismatchError,
    StreamEngine,
    StreamInputError,
    count,
    sliding,
    tumbling,
)
from runtime.swap import ModelSlot

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
    "sliding",
    "tumbling",
]
