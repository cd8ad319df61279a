"""The worker process: runs one model with one config for `runtime.worker`, nothing else.

Started as ``python -m runtime._worker_main --sock-fd N --model-fd M --parent-pid P``
with the model in an inherited sealed memfd and a Unix socket to the parent. It serves
frames from `runtime._wire` until the socket closes: ``load`` (a config), ``run``
(arrays) and ``exit``; every reply carries its request's sequence number. Expected
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
from runtime.mnn_host import fd_path, line_buffer_native_stdout

__all__ = ["main"]

FAULTS = ("segv", "abort", "kill", "hang", "exit")
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_COUNT = re.compile(r"[0-9]+")


def main(argv: list[str] | None = None) -> int:
    """Serve the parent until it closes the socket or says exit; return the exit status."""
    args = _parser().parse_args(argv)
    if not _harden(args.parent_pid):
        return 1
    line_buffer_native_stdout()  # MNN's last words before a crash reach the log
    # Terminal signals are for the app; the parent alone decides when we stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel = _wire.Channel(socket.socket(fileno=args.sock_fd))
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
            executor, reply = _load(fd_path(args.model_fd), header)
            channel.send(reply, seq=seq)
        elif op == "run" and executor is not None:
            runs += 1
            if fault and runs == fault[1] and fault[2] in ("", executor.config.key):
                _trigger(fault[0])
            reply, outputs = _run(executor, header, arrays)
            channel.send(reply, outputs, seq=seq)
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
    parser.add_argument("--model-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--fault", help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":
    sys.exit(main())
