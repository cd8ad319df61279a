"""Run one model with one backend config in this process, through MNN's Module API.

This is the thinnest layer over ``MNN.nn`` the runtime has: `Model` adds validation,
latency recording and fallback on top, and the worker process runs this very class.
Per request it writes each input into a cached placeholder, runs ``Module.forward`` and
copies the outputs out. The copy is not optional: ``Var.read()`` returns a view of a
buffer MNN reuses, so an uncopied output silently changes on the next inference.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

import runtime._mnn_diagnosis as diagnosis
import runtime.mnn_host as mnn_host
from runtime.backends import Backend, BackendConfig
from runtime.errors import (
    BackendUnavailable,
    DeadlineExceeded,
    ExecutorClosed,
    InferenceError,
    InvalidInput,
    ModelLoadError,
)
from runtime.signature import Signature, TensorSpec

__all__ = ["InProcessExecutor"]

# Input shapes MNN accepted, remembered (least recently used forgotten first) so that
# requests with them skip the process-wide log capture.
_SHAPE_MEMORY = 64


class InProcessExecutor:
    """One loaded MNN module, its config, the backend it really runs on, and its signature.

    Thread-safe: MNN modules are not, so requests are serialised by a lock (the binding
    holds the GIL through ``forward`` anyway, so nothing is lost). A request waits for
    the lock at most `deadline_s` (DeadlineExceeded): a forward stuck in MNN cannot be
    interrupted in this process, but it holds up the others only that long.
    """

    def __init__(
        self, path: str, config: BackendConfig, *, deadline_s: float | None = None
    ) -> None:
        """Load the model at `path` (a memfd path) with `config`.

        Raises BackendUnavailable if MNN would run the config on another backend, and
        ModelLoadError if MNN cannot load the model with it. `deadline_s` bounds a
        request's wait for its turn (None: no bound, as in a worker, whose parent has one).
        """
        start = time.perf_counter()
        self.config = config
        self.deadline_s = deadline_s
        self._closed = False
        mnn = mnn_host.load_mnn()
        expr = mnn.expr
        with mnn_host.native_output() as log:
            try:
                module = mnn.nn.load_module_from_file(
                    path,
                    [],
                    [],
                    backend=expr.Backend(int(config.backend)),
                    precision_mode=expr.PrecisionMode(int(config.precision)),
                    memory_mode=expr.MemoryMode(int(config.memory)),
                    thread_num=config.threads,
                )
            except Exception as exc:  # noqa: BLE001 - the binding raises bare Exception/SystemError
                module, error = None, exc
        if module is None:
            reason = diagnosis.log_reason(log.text) or str(error)
            raise ModelLoadError(f"MNN cannot load the model with {config.key}: {reason}")
        # The load's own log is the most direct evidence of what this module runs on; a
        # throwaway session is built only when the log is silent (see detect_backend).
        self.actual_backend, self.evidence = diagnosis.detect_backend(path, config, log.text)
        _refuse_fallback(config, self.actual_backend, self.evidence)
        info = module.get_info()
        self.signature = _signature(info)
        # The converter version recorded in the file, else this engine's.
        self.mnn_version = str(info.get("version") or mnn.version())
        self.load_ms = (time.perf_counter() - start) * 1000
        self._expr = expr
        self._module: Any = module
        self._feeds: list[Any] = [self._placeholder(s, s.shape) for s in self.signature.inputs]
        self._shapes = [spec.shape for spec in self.signature.inputs]
        self._packed = [spec.layout == "NC4HW4" for spec in self.signature.inputs]
        self._any_packed = any(self._packed)
        self._packed_out: list[bool] | None = None  # learnt on the first run
        self._accepted_shapes: OrderedDict[tuple[tuple[int, ...], ...], None] = OrderedDict()
        self._lock = threading.Lock()

    def run(self, arrays: Sequence[np.ndarray], exact: bool) -> dict[str, np.ndarray]:
        """Run validated inputs (in signature order); return fresh output arrays by name.

        `exact` says every input has its exported shape. When one does not and MNN says
        it cannot resize the graph to it, that is the caller's mistake: InvalidInput. Any
        other failure, at any shape, is the config's: InferenceError. DeadlineExceeded
        if requests ahead of it hold the engine for `deadline_s`.
        """
        if not self._lock.acquire(timeout=-1 if self.deadline_s is None else self.deadline_s):
            raise DeadlineExceeded(
                f"requests ahead of this one held {self.config.key} for more than "
                f"{self.deadline_s:g} s"
            )
        try:
            if self._module is None or self._closed:
                raise ExecutorClosed(f"executor for {self.config.key} is closed")
            outputs, log, error = self._run_locked(arrays, exact)
        finally:
            self._lock.release()
        if error is None:
            return outputs
        reason = diagnosis.log_reason(log)
        if diagnosis.shape_error(f"{log}\n{error}"):
            raise InvalidInput(self._shape_problem(arrays, reason or error))
        raise InferenceError(f"{error}: {reason}" if reason else str(error))

    def _run_locked(
        self, arrays: Sequence[np.ndarray], exact: bool
    ) -> tuple[dict[str, np.ndarray], str, InferenceError | None]:
        """Run holding the lock; return the outputs, or MNN's log and the error."""
        feeds = self._bind(arrays)
        if exact:
            return self._forward(feeds), "", None
        shapes = tuple(a.shape for a in arrays)
        if shapes in self._accepted_shapes:
            self._accepted_shapes.move_to_end(shapes)
            return self._forward(feeds), "", None
        # New shapes: MNN may refuse them, and says why on stdout only.
        with mnn_host.native_output() as log:
            try:
                outputs = self._forward(feeds)
            except InferenceError as exc:
                error: InferenceError | None = exc
            else:
                self._remember(shapes)
                error = None
        return ({}, log.text, error) if error else (outputs, "", None)

    def _remember(self, shapes: tuple[tuple[int, ...], ...]) -> None:
        """Remember shapes MNN accepted, forgetting the least recently used beyond the cap."""
        self._accepted_shapes[shapes] = None
        if len(self._accepted_shapes) > _SHAPE_MEMORY:
            self._accepted_shapes.popitem(last=False)

    def _shape_problem(self, arrays: Sequence[np.ndarray], reason: object) -> str:
        """Describe why MNN refused the given shapes, next to the exported ones."""
        specs = self.signature.inputs
        given = ", ".join(f"{s.name} {a.shape}" for s, a in zip(specs, arrays, strict=True))
        exported = ", ".join(f"{s.name} {s.shape}" for s in specs)
        return f"the model cannot run these shapes ({given}; exported as {exported}): {reason}"

    def restart(self) -> None:
        """Do nothing: in this process a crash leaves nothing to restart."""

    def close(self) -> None:
        """Release the module; a request still queued on the lock gets ExecutorClosed.

        Waits for a running request at most `deadline_s`; past that (a forward stuck in
        MNN) the module is released with the executor's last reference instead.
        """
        self._closed = True
        if self._lock.acquire(timeout=-1 if self.deadline_s is None else self.deadline_s):
            self._module = None
            self._feeds = []
            self._lock.release()

    def _bind(self, arrays: Sequence[np.ndarray]) -> list[Any]:
        """Write each array into its input Var, replacing the Var when the shape changes."""
        feeds, shapes = self._feeds, self._shapes
        for i, array in enumerate(arrays):
            var = feeds[i]
            # A packed input is consumed through a convert op: give it a fresh Var.
            if self._packed[i] or shapes[i] != array.shape:
                var = feeds[i] = self._placeholder(self.signature.inputs[i], array.shape)
                shapes[i] = array.shape
            var.write(array)
        if self._any_packed:
            nc4hw4 = self._expr.NC4HW4
            packed = zip(feeds, self._packed, strict=True)
            return [self._expr.convert(v, nc4hw4) if p else v for v, p in packed]
        return feeds

    def _forward(self, feeds: list[Any]) -> dict[str, np.ndarray]:
        """Run the module and copy every output out of MNN's buffers."""
        names = self.signature.outputs
        try:
            results = self._module.forward(feeds)
        except Exception as exc:  # noqa: BLE001 - the binding raises assorted types
            raise InferenceError(f"MNN failed on {self.config.key}: {exc}") from None
        if len(results) != len(names):
            raise InferenceError(
                f"MNN returned {len(results)} of {len(names)} outputs on {self.config.key}"
            )
        packed = self._packed_out
        if packed is None:
            packed = self._packed_out = [v.data_format == self._expr.NC4HW4 for v in results]
        outputs = {}
        for name, var, nc4hw4 in zip(names, results, packed, strict=True):
            if nc4hw4:
                var = self._expr.convert(var, self._expr.NCHW)
            try:
                data = var.read()
            except Exception as exc:  # noqa: BLE001
                raise InferenceError(f"MNN cannot produce output {name!r}: {exc}") from None
            if data is None:
                raise InferenceError(f"MNN produced no data for output {name!r}")
            outputs[name] = data.copy()
        return outputs

    def _placeholder(self, spec: TensorSpec, shape: Sequence[int]) -> Any:
        """Create an input Var for `spec` with `shape` (NC4HW4 inputs are fed as NCHW)."""
        expr = self._expr
        layout = expr.NHWC if spec.layout == "NHWC" else expr.NCHW
        return expr.placeholder(list(shape), layout, _MNN_TYPES[spec.dtype](expr))


_MNN_TYPES = {
    "float32": lambda e: e.float,
    "float64": lambda e: e.double,
    "int32": lambda e: e.int,
    "int64": lambda e: e.int64,
    "int8": lambda e: e.int8,
    "uint8": lambda e: e.uint8,
}


def _refuse_fallback(config: BackendConfig, actual: Backend, evidence: str) -> None:
    """Raise BackendUnavailable unless MNN runs `config` on the backend it names."""
    if actual is not config.backend:
        raise BackendUnavailable(
            f"{config.backend.name} is not available here: MNN would run {config.key} "
            f"on {actual.name} ({evidence})",
            actual,
        )


def _signature(info: dict[str, Any]) -> Signature:
    """Build the signature from ``Module.get_info()``; ModelLoadError if it is unusable."""
    specs = []
    for name, var in zip(info["inputNames"], info["inputs"], strict=True):
        dtype = mnn_host.dtype_name(var, default=str(var.dtype))
        layout = str(var.data_format).removeprefix("data_format.")
        specs.append(TensorSpec(name, tuple(var.shape), dtype, layout))
    try:
        return Signature(tuple(specs), tuple(info["outputNames"]))
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
