"""Typed errors of the on-device runtime.

Messages are one line, name the problem (which input, which config, which signal), and
never carry model bytes or tensor values. Events (`FallbackEvent`, `CrashEvent`) travel
on the exceptions so a caller can report them without digging through the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.events import CrashEvent, FallbackEvent
    from runtime.probe import ProbeResult

__all__ = [
    "BackendUnavailable",
    "DeadlineExceeded",
    "ExecutorClosed",
    "InferenceError",
    "InvalidInput",
    "ModelFailed",
    "ModelLoadError",
    "RuntimeFailure",
    "StaleSwap",
    "UnsupportedPlatform",
    "WorkerCrashed",
]


class RuntimeFailure(Exception):
    """Base class of every error the runtime reports to a caller."""


class UnsupportedPlatform(RuntimeFailure):
    """The platform lacks something the runtime needs (e.g. memfd for plaintext models)."""


class InvalidInput(RuntimeFailure, ValueError):
    """The caller's inputs do not fit the model: wrong names, dtypes, ranks or shapes.

    Also non-finite float inputs, and inputs that make a sound config's outputs
    non-finite (outside the model's domain, e.g. log of a negative number).

    Never counts against a backend config: the same inputs would fail on every one.
    """


class ModelLoadError(RuntimeFailure):
    """MNN could not load the model with one config (bad bytes, unsupported ops...)."""


class BackendUnavailable(ModelLoadError):
    """MNN would run this config on another backend (it falls back silently).

    `actual` is the backend MNN picked instead; the config is never reported as having
    run on the backend it asked for.
    """

    def __init__(self, message: str, actual: object) -> None:
        super().__init__(message)
        self.actual = actual


class InferenceError(RuntimeFailure):
    """A config failed to run valid inputs (MNN error, missing or non-finite outputs)."""


class ExecutorClosed(InferenceError):
    """The executor was closed (fallback or swap) while a request was queued on it."""


class WorkerCrashed(InferenceError):
    """The worker process died (signal, exit) or missed its deadline and was killed.

    The request that was running is lost: it is not retried, because the input itself may
    be what crashes the engine. The worker is restarted in the background (or by the next
    request), unless the crash retired its config.
    """

    def __init__(self, event: CrashEvent) -> None:
        super().__init__(event.describe())
        self.event = event


class DeadlineExceeded(RuntimeFailure, TimeoutError):
    """A request waited its whole deadline for its turn and was given up; it did not run.

    It waited behind a worker restart, a fallback loading the next config, or requests
    ahead of it that hold the engine. Nothing is wrong with the config: it never counts
    towards a fallback or a crash. (A request that ran in a worker past its deadline is
    a `WorkerCrashed` instead: that worker was killed.)
    """


class ModelFailed(RuntimeFailure):
    """No backend config is left for this model: go back to the previous version.

    ``fallbacks`` lists every step of the chain that led here, each with its reason;
    ``probe_results`` every config probed (when the model failed while starting).
    """

    def __init__(
        self,
        message: str,
        fallbacks: tuple[FallbackEvent, ...] = (),
        probe_results: tuple[ProbeResult, ...] = (),
    ) -> None:
        super().__init__(message)
        self.fallbacks = fallbacks
        self.probe_results = probe_results


class StaleSwap(RuntimeFailure):
    """A `ModelSlot` swap lost to a newer one; the stale model was closed, not installed.

    ``sequence`` is the refused swap's, ``serving`` the sequence of the version serving.
    """

    def __init__(self, message: str, sequence: int, serving: int) -> None:
        super().__init__(message)
        self.sequence = sequence
        self.serving = serving
