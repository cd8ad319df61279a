"""The worker process: runs one model with one config for `runtime.worker`, nothing else.

Started as ``python -m runtime._worker_main --sock-fd N --model-fd M --parent-pid P``
with the model in an inherited sealed memfd and a Unix socket to the parent; or, started
ahead of its model (``--warm`` instead of ``--model-fd``, see `runtime._processes.prewarm`),
it imports MNN and then receives that memfd over the socket as its first message. It serves
frames from `runtime._wire` until the socket closes: ``load`` (a config), ``run``
(arrays), ``run_batch`` (several runs' arrays in one frame, answered as they finish) and
``exit``; every reply carries its request's sequence number. Expected
failures go back as ``{"ok": false, "kind": ...}`` replies; a native crash simply kills
this process, which is the point of having it.

This process holds decrypted weights, so before anything else it makes itself
undumpable (no core file, no ptrace by other users' processes) and asks the kernel to
SIGKILL it when the parent dies, even if it is hung in native code then.

``--fault`` exists for tests only (see `runtime.worker.Fault`): the parent passes it
only when a `Fault` object was given to it explicitly.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import Any

import runtime._wire as _wire
from runtime.backends import BackendConfig
from runtime.engine import InProcessExecutor
from runtime.errors import (
    BackendUnavailable,
    InferenceError,
    InvalidInput,
    ModelLoadError,
)
from runtime.hardening import forbid_core_dumps
from runtime.mnn_host import fd_path, line_buffer_native_stdout, load_mnn

__all__ = ["main"]

FAULTS = ("segv", "abort", "kill", "hang", "exit")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_COUNT = re.compile(r"[0-9]+")
# A batch's answers go back at least this often (and at its end), so the parent, which
# waits at most its deadline for each frame, sees a long batch make progress.
FLUSH_NS = 2_000_000
FLUSH_BYTES = 16 << 20  # and before their outputs grow past this,
FLUSH_HEADER = 256 << 10  # or their header (errors) past this: a frame's header is bounded
_ERROR_CHARS = 2000


def main(argv: list[str] | None = None) -> int:
    """Serve the parent until it closes the socket or says exit; return the exit status."""
    args = _parser().parse_args(argv)
    if not _harden(args.parent_pid):
        return 1
    line_buffer_native_stdout()  # MNN's last words before a crash reach the log
    # Terminal signals are for the app; the parent alone decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sock = socket.socket(fileno=args.sock_fd)
    model_fd = args.model_fd if args.model_fd is not None else _await_model(sock)
    if model_fd is None:
        return 0  # prewarmed, then not needed: the parent closed the socket
    channel = _wire.Channel(sock)
    fault = _parse_fault(args.fault) if args.fault else None
    executor: InProcessExecutor | None = None
    runs = 0
    while True:
        try:
            seq, header, arrays = channel.recv()
        except (EOFError, ConnectionError, _wire.ProtocolError):
            return 0  # the parent is gone or talking nonsense: nothing left to serve
        op = header.get("op")
        if op == "load":
            if executor is not None:
                executor.close()
            executor, reply = _load(fd_path(model_fd), header)
            channel.send(reply, seq=seq)
        elif op == "run" and executor is not None:
            runs += 1
            if fault and runs == fault[1] and fault[2] in ("", executor.config.key):
                _trigger(fault[0])
            reply, outputs = _run(executor, header, arrays)
            channel.send(reply, outputs, seq=seq)
        elif op == "run_batch" and executor is not None:
            batch = _Batch(channel, seq)
            for index, inputs, exact in _batch_items(executor, header, arrays, batch):
                runs += 1
                if fault and runs == fault[1] and fault[2] in ("", executor.config.key):
                    _trigger(fault[0])
                batch.answer(index, *_run(executor, {"exact": exact}, inputs))
            batch.flush()
        elif op == "exit":
            return 0
        else:
            channel.send({"ok": False, "kind": "protocol", "error": f"bad op {op!r}"}, seq=seq)


def _harden(parent_pid: int) -> bool:
    """Keep decrypted weights out of core dumps and die with the parent; False if it is gone.

    The death signal is armed first, then the parent checked: had it died before, we
    would already be some other process's child and the signal would never come.
    """
    forbid_core_dumps()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return os.getppid() == parent_pid


def _await_model(sock: socket.socket) -> int | None:
    """Prewarmed (``--warm``): import MNN now, then wait for the model's memfd (SCM_RIGHTS).

    Returns None if the parent closed the socket instead.
    """
    load_mnn()
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1, 1)
    except OSError:
        return None
    if not data or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return None
    return fds[0]


def _load(path: str, header: dict[str, Any]) -> tuple[InProcessExecutor | None, dict]:
    """Load the model with the requested config; return the executor and the reply."""
    try:
        executor = InProcessExecutor(path, BackendConfig.from_dict(header["config"]))
    except BackendUnavailable as exc:
        reply = {"ok": False, "kind": "unavailable", "error": str(exc)}
        return None, {**reply, "actual": exc.actual.name}
    except (ModelLoadError, ValueError, KeyError) as exc:
        return None, {"ok": False, "kind": "load", "error": str(exc)}
    except Exception as exc:  # noqa: BLE001 - the MNN binding raises bare Exception
        return None, {"ok": False, "kind": "load", "error": f"{type(exc).__name__}: {exc}"}
    reply = {
        "ok": True,
        "signature": executor.signature.to_dict(),
        "actual_backend": executor.actual_backend.name,
        "evidence": executor.evidence,
        "load_ms": executor.load_ms,
        "pid": os.getpid(),
    }
    return executor, reply


def _run(executor: InProcessExecutor, header: dict, arrays: dict) -> tuple[dict, dict]:
    """Run one request; return the reply header and the output arrays."""
    names = executor.signature.input_names
    if list(arrays) != list(names):
        return {"ok": False, "kind": "invalid_input", "error": "inputs out of order"}, {}
    try:
        outputs = executor.run([arrays[n] for n in names], bool(header.get("exact")))
    except InvalidInput as exc:
        return {"ok": False, "kind": "invalid_input", "error": str(exc)}, {}
    except InferenceError as exc:
        return {"ok": False, "kind": "inference", "error": str(exc)}, {}
    return {"ok": True}, outputs


class _Batch:
    """The answers to one ``run_batch`` request, sent back in frames as they accumulate.

    Each frame's header lists ``[index, kind, error]`` per answered item (kind "" when
    it ran: its outputs are the arrays ``"<index>/<output>"``).
    """

    def __init__(self, channel: _wire.Channel, seq: int) -> None:
        self._channel, self._seq = channel, seq
        self._items: list[list] = []
        self._outputs: dict[str, Any] = {}
        self._bytes = self._head = 0
        self._flushed = time.perf_counter_ns()

    def answer(self, index: int, reply: dict, outputs: dict) -> None:
        """Keep one item's answer; send what is kept if it is time to."""
        if reply["ok"]:
            self._items.append([index, "", ""])
            for name, array in outputs.items():
                self._outputs[f"{index}/{name}"] = array
                self._bytes += array.nbytes
        else:
            error = reply["error"][:_ERROR_CHARS]
            self._items.append([index, reply["kind"], error])
            self._head += 12 * len(error)  # at most 12 bytes of JSON per character
        self._head += 64
        now = time.perf_counter_ns()
        full = self._bytes >= FLUSH_BYTES or self._head >= FLUSH_HEADER
        if full or now - self._flushed >= FLUSH_NS:
            self.flush(now)

    def flush(self, now: int = 0) -> None:
        """Send the answers kept so far (if any)."""
        if self._items:
            self._channel.send({"ok": True, "items": self._items}, self._outputs, seq=self._seq)
        self._items, self._outputs, self._bytes, self._head = [], {}, 0, 0
        self._flushed = now or time.perf_counter_ns()


def _batch_items(executor: InProcessExecutor, header: dict, arrays: dict, batch: _Batch):
    """Yield (index, inputs, exact) for each item of a ``run_batch`` request, in order.

    Item i's inputs are the arrays ``"<i>/<input>"``, and ``header["exact"][i]`` its
    exact flag. A request that does not hold exactly that has every item answered
    "invalid_input" in `batch`, and none run.
    """
    exact = header.get("exact")
    names = executor.signature.input_names
    count = len(exact) if isinstance(exact, list) else 0
    expected = [f"{i}/{name}" for i in range(count) for name in names]
    if not count or list(arrays) != expected:
        error = {"ok": False, "kind": "invalid_input", "error": "batch inputs out of order"}
        for i in range(max(count, 1)):
            batch.answer(i, error, {})
    else:
        for i in range(count):
            yield i, {name: arrays[f"{i}/{name}"] for name in names}, bool(exact[i])


def _trigger(kind: str) -> None:
    """Die the requested way: a real native fault, not a Python exception.

    It is announced through C stdio, as MNN logs, so the crash report shows whether
    native log lines survive a crash.
    """
    sys.stdout.flush()
    ctypes.CDLL(None).printf(b"skiff worker: injected fault %s\n", kind.encode())
    if kind == "segv":
        ctypes.string_at(0)  # read address 0: SIGSEGV from the kernel, like a bad kernel
    elif kind == "abort":
        os.abort()
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # what the OOM killer sends
    elif kind == "hang":
        threading.Event().wait()  # never set: only the parent's deadline ends this
    os._exit(3)


def _parse_fault(text: str) -> tuple[str, int, str]:
    """Parse ``KIND@N[@CONFIG_KEY]``: die the KIND way on run request N (for CONFIG_KEY)."""
    kind, count, *config = text.split("@", 2) + [""]
    # ASCII digits only: str.isdigit() also accepts "²", which int() then refuses.
    if kind not in FAULTS or not _COUNT.fullmatch(count) or int(count) < 1:
        raise SystemExit(f"bad --fault {text!r}")
    return kind, int(count), config[0] if config else ""


def _parser() -> argparse.ArgumentParser:
    """Build the command-line parser."""
    parser = argparse.ArgumentParser(prog="python -m runtime._worker_main")
    parser.add_argument("--sock-fd", type=int, required=True)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--model-fd", type=int)
    # Started before the model exists (runtime._processes.prewarm): it comes over the socket.
    model.add_argument("--warm", action="store_true")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--fault", help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":
    sys.exit(main())
