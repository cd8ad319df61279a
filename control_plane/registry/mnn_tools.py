"""Validate, convert and compress uploaded models with the real MNN engine, out of process.

The parent side of `control_plane.registry.mnn_worker`. This module never imports MNN:
each call runs one short-lived ``python -m control_plane.registry.mnn_worker`` child with a
timeout, handing it models as memfds so plaintext never reaches a filesystem (the worker
even redirects the converter's own scratch file into memory). Whatever the child does
(refuses, crashes, hangs), the caller gets a typed `errors.InvalidModel` with a one-line message.

Callers' descriptors are only read through ``os.pread`` or fresh opens of
``/proc/self/fd/N`` in the child, so their offsets are never moved and they stay open.
The child runs confined (`control_plane.registry.mnn_sandbox`): empty environment, its own
user when we are root, capped memory and CPU, seccomp; a breached limit is named in the error.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

from contract import errors
from control_plane.registry.contract import DERIVED_VARIANTS
from control_plane.registry.mnn_sandbox import Sandbox, child_env, default_sandbox
from runtime.golden import MAX_GOLDEN_BYTES
from runtime.npz import read_npz

__all__ = [
    "VARIANTS",
    "VARIANT_FLAGS",
    "ModelSignature",
    "TensorSpec",
    "convert_onnx",
    "inspect_model",
    "make_variant",
    "GoldenRun",
    "run_golden",
    "sniff_format",
]

# Converter flags per variant, applied to an .mnn input (``-f MNN``). Weight quantisation
# shrinks the file; MNN dequantises on load unless a device opts into low-memory mode.
# int8 stays symmetric and channel-wise, the format even old MNN runtimes read. Plain 4-bit
# loses too much: on random-normal MLP weights the relative output error was 23% channel-wise,
# 20% asymmetric with 64-wide blocks and 14% with HQQ-fitted 64-wide blocks (int8: 1.4%,
# fp16: 0.15%), so int4 uses HQQ blocks (asymmetric; needs a recent MNN runtime). Layers whose
# input width is not a multiple of the block are silently quantised channel-wise instead.
VARIANT_FLAGS: dict[str, tuple[str, ...]] = {
    "fp16": ("--fp16",),
    "int8": ("--weightQuantBits", "8"),
    "int4": (
        "--weightQuantBits",
        "4",
        "--weightQuantAsymmetric",
        "--hqq",
        "--weightQuantBlock",
        "64",
    ),
}
VARIANTS = DERIVED_VARIANTS

INSPECT_TIMEOUT_S = 120.0
CONVERT_TIMEOUT_S = 300.0
_MESSAGE_LIMIT = 300  # characters; messages travel to clients in gRPC status details
# What the publisher must fix (every missing --input-shape/--input-range at once) is ours
# to word, not MNN's: it may take a few more.
_CALLER_MESSAGE_LIMIT = 1000
# What a child that ran out of address space leaves in its log: Python's MemoryError,
# C++'s std::bad_alloc, MNN's own allocation failures, glibc's ENOMEM.
_OUT_OF_MEMORY = ("MemoryError", "bad_alloc", "Alloc memory", "alloc memory", "Cannot allocate")
_ALLOCATION_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)

log = logging.getLogger(__name__)
_warned_unconfined = False


WORKER_MODULE = "control_plane.registry.mnn_worker"


@dataclass(frozen=True)
class TensorSpec:
    """One model input or output: dims are -1 where dynamic; unknown shapes are ()."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # numpy-style name such as "float32", or "unknown"


@dataclass(frozen=True)
class ModelSignature:
    """A model's inputs and outputs as MNN sees them, plus the MNN version that wrote it.

    ``mnn_version`` is the converter version recorded in the file (MNN's ``get_info()``),
    falling back to the engine's own version for files that record none.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    mnn_version: str

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict for storage; `from_dict` reverses it."""
        return {
            "inputs": [_spec_dict(spec) for spec in self.inputs],
            "outputs": [_spec_dict(spec) for spec in self.outputs],
            "mnn_version": self.mnn_version,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelSignature:
        """Rebuild a signature from `to_dict` output (or the worker's JSON)."""
        return cls(
            inputs=tuple(_spec_from(item) for item in d["inputs"]),
            outputs=tuple(_spec_from(item) for item in d["outputs"]),
            mnn_version=str(d["mnn_version"]),
        )


def inspect_model(
    fd: int, *, timeout: float = INSPECT_TIMEOUT_S, sandbox: Sandbox | None = None
) -> ModelSignature:
    """Load the .mnn in `fd` with MNN, run it once on zeros if its shapes are static.

    Raises errors.InvalidModel("not a valid MNN model: ...") if MNN cannot load or run it.
    """
    _require_content(fd)
    args = ["--model-fd", str(fd)]
    result = run_worker("inspect", args, (fd,), timeout, "not a valid MNN model", sandbox)
    return ModelSignature.from_dict(result["signature"])


def convert_onnx(
    src_fd: int, *, timeout: float = CONVERT_TIMEOUT_S, sandbox: Sandbox | None = None
) -> int:
    """Convert the ONNX model in `src_fd` to MNN; return a new memfd holding the .mnn."""
    _require_content(src_fd)
    prefix = "ONNX model could not be converted"
    return _convert("convert", [], src_fd, timeout, prefix, sandbox)


def make_variant(
    src_fd: int,
    variant: str,
    *,
    timeout: float = CONVERT_TIMEOUT_S,
    sandbox: Sandbox | None = None,
) -> int:
    """Write the named variant (see VARIANTS) of the .mnn in `src_fd` to a new memfd."""
    if variant not in VARIANTS:
        raise errors.InvalidArgument(f"unknown variant {variant!r}; expected one of {VARIANTS}")
    _require_content(src_fd)
    prefix = f"{variant} variant could not be made"
    return _convert("variant", ["--variant", variant], src_fd, timeout, prefix, sandbox)


@dataclass(frozen=True)
class GoldenRun:
    """What one golden run produced: outputs by name, and for a recipe run its inputs."""

    outputs: dict[str, np.ndarray]
    inputs: dict[str, np.ndarray] | None = None  # built by the child (recipe runs)
    input_specs: tuple[TensorSpec, ...] = ()  # the model's declared inputs (recipe runs)
    mnn_version: str = ""


def run_golden(
    fd: int,
    inputs_fd: int,
    *,
    recipe: str | None = None,
    prefix: str = "golden inputs could not be run",
    timeout: float = INSPECT_TIMEOUT_S,
    sandbox: Sandbox | None = None,
) -> GoldenRun:
    """Run golden inputs through the .mnn in `fd` with the reference config, in a child.

    Without `recipe`, `inputs_fd` holds the ``.npz`` of inputs. With `recipe` (JSON
    ``{"input_shapes": ..., "input_ranges": ...}``), the child inspects the model and
    builds the inputs itself from its signature, the hints and the publisher's ``.npz``
    in `inputs_fd` (empty: seeded), so one child does what took two. Raises
    errors.InvalidArgument for inputs or hints the model cannot take, and
    errors.InvalidModel with `prefix` if MNN cannot load or run it or its outputs exceed
    MAX_GOLDEN_BYTES.
    """
    _require_content(fd)
    with contextlib.ExitStack() as stack:
        out = _scratch(stack, "skiff-golden-outputs")
        argv = ["--model-fd", str(fd), "--inputs-fd", str(inputs_fd), "--outputs-fd", str(out)]
        fds = [fd, inputs_fd, out]
        if recipe is not None:
            recipe_fd, built = (
                _scratch(stack, "skiff-golden-recipe"),
                _scratch(stack, "skiff-golden-built"),
            )
            os.pwrite(recipe_fd, recipe.encode(), 0)
            argv += ["--recipe-fd", str(recipe_fd), "--built-fd", str(built)]
            fds += [recipe_fd, built]
        result = run_worker("golden", argv, tuple(fds), timeout, prefix, sandbox)
        outputs = _read_arrays(out, prefix, "outputs")
        order = [str(spec["name"]) for spec in result["outputs"]]
        if sorted(order) != sorted(outputs):
            raise errors.InvalidModel(f"{prefix}: the worker's outputs do not match its report")
        run = GoldenRun({name: outputs[name] for name in order})
        if recipe is None:
            return run
        inputs = _read_arrays(built, prefix, "inputs")
        specs = tuple(_spec_from(item) for item in result["inputs"])
        if sorted(inputs) != sorted(spec.name for spec in specs):
            raise errors.InvalidModel(f"{prefix}: the worker's inputs do not match its report")
        ordered = {spec.name: inputs[spec.name] for spec in specs}
        return GoldenRun(run.outputs, ordered, specs, str(result["mnn_version"]))


def _scratch(stack: contextlib.ExitStack, name: str) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    stack.callback(os.close, fd)
    return fd


def _read_arrays(fd: int, prefix: str, what: str) -> dict[str, np.ndarray]:
    """Read an ``.npz`` the child wrote, refusing one over MAX_GOLDEN_BYTES unread."""
    size = os.fstat(fd).st_size
    if size > MAX_GOLDEN_BYTES:
        raise errors.InvalidModel(
            f"{prefix}: its {what} take {size >> 20} MiB (limit {MAX_GOLDEN_BYTES >> 20} MiB)"
        )
    try:
        return read_npz(os.pread(fd, size, 0), f"the worker's {what}", MAX_GOLDEN_BYTES)
    except ValueError as exc:
        raise errors.InvalidModel(f"{prefix}: {exc}") from None


def sniff_format(fd: int) -> str:
    """Return "onnx", "mnn", "gguf" or "mnn-llm" judging by the content of `fd`.

    A GGUF (a language model) starts with its magic; the child that converts it checks
    the rest of its header. A tar (ustar magic) is an MNN-LLM bundle: the child reads it
    without trusting it. The offset of `fd` is left alone.
    """
    size = _require_content(fd)
    if os.pread(fd, 4, 0) == b"GGUF":
        return "gguf"
    if os.pread(fd, 5, 257) == b"ustar":
        return "mnn-llm"
    if _looks_like_onnx(fd, size):
        return "onnx"
    if _looks_like_mnn(fd, size):
        return "mnn"
    raise errors.InvalidModel(
        "unrecognised model format: neither an ONNX, an MNN, a GGUF model nor an MNN-LLM "
        "bundle (a directory or a tar)"
    )


def _convert(
    op: str, extra: list[str], src_fd: int, timeout: float, prefix: str, sandbox: Sandbox | None
) -> int:
    """Run a converting worker op from `src_fd` into a fresh memfd and return it."""
    dst = os.memfd_create(f"skiff-{op}", os.MFD_CLOEXEC)
    try:
        argv = ["--src-fd", str(src_fd), "--dst-fd", str(dst), *extra]
        run_worker(op, argv, (src_fd, dst), timeout, prefix, sandbox)
        if not _looks_like_mnn(dst, os.fstat(dst).st_size):
            raise errors.InvalidModel(f"{prefix}: the converter's output is not an MNN model")
    except BaseException:
        os.close(dst)
        raise
    return dst


def run_worker(
    op: str,
    args: list[str],
    fds: tuple[int, ...],
    timeout: float,
    prefix: str,
    sandbox: Sandbox | None = None,
) -> dict[str, Any]:
    """Run one worker op in a confined child process; return its result or raise InvalidModel."""
    sandbox = sandbox or default_sandbox()
    result = os.memfd_create("skiff-mnn-result", os.MFD_CLOEXEC)
    log_fd = os.memfd_create("skiff-mnn-log", os.MFD_CLOEXEC)  # memfd: no pipe to drain
    # -P: the working directory is not put on sys.path. It belongs to the child's user,
    # and the child imports modules (argparse, numpy...) while it is still root, so a
    # module planted there would otherwise run as root.
    argv = [sys.executable, "-P", "-m", WORKER_MODULE, op, "--result-fd", str(result)]
    try:
        with sandbox.workdir() as scratch:
            proc = subprocess.run(
                [*argv, *sandbox.worker_args(), *args],
                stdin=subprocess.DEVNULL,
                stdout=log_fd,
                stderr=log_fd,
                pass_fds=(result, *fds),  # every other descriptor is closed
                cwd=scratch,
                env=child_env(),
                timeout=timeout,
                check=False,
            )
        outcome = _Outcome(proc.returncode, _read_text(result), _read_text(log_fd), prefix)
        return outcome.judge(sandbox)
    except subprocess.TimeoutExpired:
        raise errors.InvalidModel(f"{prefix}: MNN took longer than {timeout:g} s") from None
    finally:
        os.close(result)
        os.close(log_fd)


@dataclass(frozen=True)
class _Outcome:
    """What a finished child left: exit status, JSON result and log."""

    returncode: int
    result: str
    log: str
    prefix: str

    def judge(self, sandbox: Sandbox) -> dict[str, Any]:
        """Return the child's result, or raise InvalidModel saying what went wrong."""
        payload = self._payload()
        if payload is not None and payload.get("forbidden_modules"):
            # Not the model's fault: the worker's import guard failed. Refuse loudly.
            raise RuntimeError(
                f"MNN worker loaded forbidden modules {payload['forbidden_modules']}"
            )
        if payload is not None:
            _warn_if_unconfined(payload.get("confinement") or {})
        if payload is not None and payload["ok"] and self.returncode == 0:
            return payload
        if self.returncode == -signal.SIGXCPU:
            raise self._error(f"MNN used more than {sandbox.describe_limit('cpu')}")
        if any(marker in self.log or marker in self.result for marker in _OUT_OF_MEMORY):
            raise self._error(f"MNN ran out of {sandbox.describe_limit('memory')}")
        if payload is not None and not payload["ok"] and payload.get("caller_error"):
            raise errors.InvalidArgument(_one_line(str(payload["error"]), _CALLER_MESSAGE_LIMIT))
        if payload is not None and not payload["ok"]:
            raise self._error(payload["error"])
        lines = self.log.splitlines()
        last = next((line for line in reversed(lines) if line.strip()), "no output")
        if self.returncode < 0:
            what = f"MNN crashed ({signal.Signals(-self.returncode).name})"
            if -self.returncode in _ALLOCATION_SIGNALS:
                # MNN rarely checks malloc: a model too big for the limit dies like this.
                what += f", as models needing more than {sandbox.describe_limit('memory')} do"
        else:
            what = f"MNN worker exited with status {self.returncode}"
        raise self._error(f"{what}; last output: {last}")

    def _payload(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.result) if self.result.strip() else None
        except ValueError:  # cut short by a crash mid-write; the exit status says what happened
            return None

    def _error(self, message: str) -> errors.InvalidModel:
        return errors.InvalidModel(_one_line(f"{self.prefix}: {message}"))


def _outcome(returncode: int, result: str, log: str, prefix: str) -> dict[str, Any]:
    """Judge a finished child against the default sandbox (see `_Outcome.judge`)."""
    return _Outcome(returncode, result, log, prefix).judge(default_sandbox())


def _warn_if_unconfined(confinement: dict[str, Any]) -> None:
    """Log once per process when a child ran without seccomp (never fail for it)."""
    global _warned_unconfined
    state = str(confinement.get("seccomp", "on"))
    if state != "on" and not _warned_unconfined:
        _warned_unconfined = True
        log.warning("MNN children run without a seccomp filter: %s", state)


# ModelProto field number -> protobuf wire type (0 varint, 2 length-delimited), onnx 1.17.
_ONNX_MODEL_FIELDS = {1: 0, 2: 2, 3: 2, 4: 2, 5: 0, 6: 2, 7: 2, 8: 2, 14: 2, 20: 2, 25: 2, 26: 2}
_ONNX_MAX_TOP_FIELDS = 100_000  # real models have dozens; bounds the scan of hostile input
_MNN_OPLISTS_SLOT = 3  # MNN.fbs: table Net { bizCode, extraTensorDescribe, extraInfo, oplists }


def _looks_like_onnx(fd: int, size: int) -> bool:
    """Walk the top-level protobuf fields: all must be ModelProto's and end exactly at EOF."""
    pos, fields, seen_graph = 0, 0, False
    while pos < size and fields < _ONNX_MAX_TOP_FIELDS:
        head = os.pread(fd, 20, pos)
        key, cursor = _varint(head, 0)
        value, cursor = _varint(head, cursor)
        if key is None or value is None or _ONNX_MODEL_FIELDS.get(key >> 3) != key & 7:
            return False
        pos += cursor + (value if key & 7 == 2 else 0)
        fields += 1
        seen_graph = seen_graph or key >> 3 == 7
    return seen_graph and pos == size


def _looks_like_mnn(fd: int, size: int) -> bool:
    """Check the flatbuffer root table and vtable are in bounds and the op list is set."""
    if size < 16:
        return False
    root = int.from_bytes(os.pread(fd, 4, 0), "little")
    if root % 4 or root + 4 > size:
        return False
    vtable = root - int.from_bytes(os.pread(fd, 4, root), "little", signed=True)
    if vtable < 4 or vtable + 4 > size:
        return False
    vt_len, table_len = (int.from_bytes(os.pread(fd, 2, vtable + i), "little") for i in (0, 2))
    if vt_len < 4 or vt_len % 2 or vtable + vt_len > size or table_len < 4:
        return False
    if root + table_len > size:
        return False
    raw = os.pread(fd, vt_len - 4, vtable + 4)
    slots = [int.from_bytes(raw[i : i + 2], "little") for i in range(0, len(raw), 2)]
    in_table = all(slot < table_len for slot in slots)
    return in_table and len(slots) > _MNN_OPLISTS_SLOT and slots[_MNN_OPLISTS_SLOT] != 0


def _varint(buf: bytes, start: int) -> tuple[int | None, int]:
    """Decode a protobuf varint at `start`; return (None, start) if it is incomplete."""
    value = 0
    for i in range(start, min(len(buf), start + 10)):
        value |= (buf[i] & 0x7F) << (7 * (i - start))
        if not buf[i] & 0x80:
            return value, i + 1
    return None, start


def _require_content(fd: int) -> int:
    """Return the size of the file behind `fd`; an empty file is the caller's mistake."""
    size = os.fstat(fd).st_size
    if size == 0:
        raise errors.InvalidArgument("model file is empty")
    return size


def _read_text(fd: int) -> str:
    """Read a small memfd written by the child."""
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")


def _one_line(message: str, limit: int = _MESSAGE_LIMIT) -> str:
    """Collapse whitespace and cap the length, so errors stay one short line."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _spec_dict(spec: TensorSpec) -> dict[str, Any]:
    """Return one TensorSpec as a JSON-able dict."""
    return {"name": spec.name, "shape": list(spec.shape), "dtype": spec.dtype}


def _spec_from(item: dict[str, Any]) -> TensorSpec:
    """Build a TensorSpec from its dict form."""
    return TensorSpec(str(item["name"]), tuple(int(d) for d in item["shape"]), str(item["dtype"]))
