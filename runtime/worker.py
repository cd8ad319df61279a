"""Crash isolation: run a model in a worker process the runtime can kill and restart.

A `WorkerExecutor` is a drop-in for `InProcessExecutor` whose MNN lives in a child
process (`runtime._worker_main`). The model reaches the child as an inherited sealed
memfd (no plaintext on disk); requests and replies are `runtime._wire` frames over a
Unix socketpair. Every request has a deadline. When the child dies (SIGSEGV, SIGABRT, the
OOM killer's SIGKILL, any exit) or misses the deadline (then it is SIGKILLed), the
request fails with `WorkerCrashed` carrying a `CrashEvent` (signal name, reason, last
log line). `restart()` starts a fresh worker with the same model and config (the next
request also does, if nobody did); counting crashes toward fallback, and restarting
unless the config is retired, is the model's job (`runtime.model`).

Detection never depends on timing: a dead child closes its end of the socket, so the
blocked read returns EOF at once, and ``wait()`` reports the signal. A request that is
interrupted midway (KeyboardInterrupt, a signal handler's exception) kills the worker
too: its reply would otherwise be read as the answer to the next request.

Workers get a minimal environment and die with this process (``PR_SET_PDEATHSIG``).
The kernel sends that signal when the *thread* that forked the child exits, so every
worker is spawned from one long-lived thread, never from a short-lived caller thread.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime import _wire
from runtime._memfd import memfd
from runtime.backends import Backend, BackendConfig
from runtime.errors import (
    BackendUnavailable,
    ExecutorClosed,
    InferenceError,
    InvalidInput,
    ModelLoadError,
    RuntimeFailure,
    WorkerCrashed,
)
from runtime.events import CrashEvent
from runtime.signature import Signature

__all__ = ["DEFAULT_DEADLINE_S", "Fault", "WorkerExecutor"]

logger = logging.getLogger("runtime")

DEFAULT_DEADLINE_S = 10.0
LOAD_DEADLINE_S = 300.0  # loading (and GPU kernel tuning) of a big model is slow
_EXIT_GRACE_S = 5.0
_LOG_TAIL = 4096
_LOG_LIMIT, _LOG_KEEP = 64 * 1024, 32 * 1024  # past the limit, only the last part is kept
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
# What a worker inherits: enough to start Python and MNN, nothing of the app's secrets.
# LD_LIBRARY_PATH: embedded interpreters (e.g. on Android) may need it to start at all.
_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONHOME", "LD_LIBRARY_PATH")
# Never shut down: its thread must outlive every worker (see the module docstring).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skiff-worker-spawner")


@dataclass(frozen=True)
class Fault:
    """Test-only: make the worker die on purpose, to prove crashes are contained.

    The worker dies the `kind` way ("segv", "abort", "kill", "hang", "exit") on its
    `on_request`-th run request (counted per worker process, so a restarted worker
    faults again), and only while running `config` if that is set. Nothing but an
    explicit `Fault` object passed to the executor arms it.
    """

    kind: str
    on_request: int = 1
    config: BackendConfig | None = None

    def arg(self) -> str:
        """Return the worker's --fault argument."""
        key = f"@{self.config.key}" if self.config else ""
        return f"{self.kind}@{self.on_request}{key}"


class WorkerExecutor:
    """One model with one config, run by a child process that may crash."""

    def __init__(
        self,
        model_fd: int,
        config: BackendConfig,
        *,
        deadline_s: float = DEFAULT_DEADLINE_S,
        fault: Fault | None = None,
    ) -> None:
        """Start a worker and load the model in it with `config`.

        Raises BackendUnavailable or ModelLoadError like `InProcessExecutor`, and
        WorkerCrashed if the worker dies while loading.
        """
        self.config = config
        self.deadline_s = deadline_s
        self._model_fd, self._fault = model_fd, fault
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._channel: _wire.Channel | None = None
        self._log_fd = -1
        self._seq = 0
        self._closed = False
        self.restarts = 0
        self._start()

    @property
    def pid(self) -> int | None:
        """Return the worker's process id (None while it is down)."""
        return self._proc.pid if self._proc else None

    def run(self, arrays: Sequence[np.ndarray], exact: bool) -> dict[str, np.ndarray]:
        """Run validated inputs in the worker; see `InProcessExecutor.run`."""
        with self._lock:
            if self._closed:
                raise ExecutorClosed(f"executor for {self.config.key} is closed")
            if self._channel is None:  # nobody restarted it yet, or that failed: now
                self.restarts += 1
                self._start()
            names = self.signature.input_names
            request = {"op": "run", "exact": exact}
            reply, outputs = self._call(request, dict(zip(names, arrays, strict=True)))
            self._trim_log()
        if not reply.get("ok"):
            kind, error = reply.get("kind"), str(reply.get("error", "worker error"))
            raise InvalidInput(error) if kind == "invalid_input" else InferenceError(error)
        if list(outputs) != list(self.signature.outputs):
            expected = list(self.signature.outputs)
            raise InferenceError(f"worker returned outputs {list(outputs)}, not {expected}")
        return outputs

    def close(self) -> None:
        """Stop the worker: ask it to exit, then kill it if it does not."""
        with self._lock:
            self._closed = True
            self._stop(graceful=True)

    def _start(self) -> None:
        """Spawn a worker and load the model; leaves it down if anything fails."""
        self._spawn()
        try:
            self._load()
        except BaseException as exc:
            self._stop(graceful=isinstance(exc, RuntimeFailure))  # no-op if reaped already
            raise

    def _spawn(self) -> None:
        """Start the worker process, connected by a fresh socketpair and log memfd."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        log_fd = memfd("skiff-worker-log")
        # Shared with the worker's stdout and stderr: appending, they keep writing at the
        # end after `_trim_log` shortens the file, instead of past a hole.
        fcntl.fcntl(log_fd, fcntl.F_SETFL, fcntl.fcntl(log_fd, fcntl.F_GETFL) | os.O_APPEND)
        argv = [sys.executable, "-m", "runtime._worker_main", "--parent-pid", str(os.getpid())]
        argv += ["--sock-fd", str(child.fileno()), "--model-fd", str(self._model_fd)]
        if self._fault is not None:
            argv += ["--fault", self._fault.arg()]
        options = {
            "stdin": subprocess.DEVNULL,
            "stdout": log_fd,
            "stderr": log_fd,
            "pass_fds": (child.fileno(), self._model_fd),
            "env": _child_env(),
            "start_new_session": True,  # Ctrl-C in the app's terminal is not for us
        }
        try:
            self._proc = _spawn(argv, options)
        except BaseException:
            parent.close()
            os.close(log_fd)
            raise
        finally:
            child.close()
        self._channel, self._log_fd = _wire.Channel(parent), log_fd

    def _load(self) -> None:
        """Have the freshly spawned worker load the model; raise as InProcessExecutor does."""
        load = {"op": "load", "config": self.config.to_dict()}
        reply, _ = self._call(load, None, deadline_s=LOAD_DEADLINE_S)
        if not reply.get("ok"):
            error = str(reply.get("error", "worker could not load the model"))
            if reply.get("kind") == "unavailable":
                # Never name a backend nothing ran on: unknown stays unknown.
                raise BackendUnavailable(error, Backend.__members__.get(str(reply.get("actual"))))
            raise ModelLoadError(error)
        try:
            self.signature = Signature.from_dict(reply["signature"])
            self.actual_backend = Backend[reply["actual_backend"]]
            self.evidence = str(reply["evidence"])
            self.load_ms = float(reply["load_ms"])
        except (KeyError, TypeError, ValueError) as exc:  # a worker gone wrong: stop it
            self._stop(graceful=False)
            raise ModelLoadError(f"worker sent a malformed load reply ({exc!r})") from None
        if self.actual_backend is not self.config.backend:  # never trust a lying worker
            message = f"worker ran {self.config.key} on {self.actual_backend.name}"
            raise BackendUnavailable(message, self.actual_backend)

    def _call(
        self,
        header: dict,
        arrays: dict | None,
        *,
        deadline_s: float | None = None,
    ) -> tuple[dict, dict[str, np.ndarray]]:
        """Send one request and wait for its reply; on death or timeout, reap and raise."""
        assert self._channel is not None
        deadline = time.monotonic() + (deadline_s or self.deadline_s)
        self._seq = seq = (self._seq + 1) & 0xFFFF_FFFF
        try:
            self._channel.send(header, arrays, seq=seq)
            reply = self._channel.recv(deadline=deadline)
            if reply.seq != seq:  # cannot happen unless the worker is confused or hostile
                raise _wire.ProtocolError(f"reply to request {reply.seq}, not {seq}")
            return reply.header, reply.arrays
        except _wire.FrameTooLarge as exc:  # refused before sending: the worker is fine
            raise InvalidInput(f"inputs too large for a worker: {exc}") from None
        except TimeoutError:
            event = self._reap("deadline")
        except _wire.ProtocolError as exc:  # the child is not to be trusted any more
            event = self._reap("protocol", str(exc))
        except (EOFError, OSError):  # ConnectionError, BrokenPipeError: the child is gone
            event = self._reap("died")
        except BaseException:
            # Interrupted mid-request: its reply may still come and be taken for the
            # next request's, so this worker must go.
            self._reap("interrupted")
            raise
        raise WorkerCrashed(event)

    def _reap(self, how: str, detail: str = "") -> CrashEvent:
        """Make sure the worker is dead, collect how it died, and tidy up."""
        proc = self._proc
        assert proc is not None
        code = None
        if how == "died":
            try:
                code = proc.wait(timeout=_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:  # closed the socket yet lives on: end it
                pass
        if code is None:  # still alive: hung, talking nonsense, or interrupted
            code = _kill(proc)
        detail = detail or self._log_tail()
        self._teardown()
        if how != "died":
            return CrashEvent(self.config, how, "SIGKILL", None, detail)
        if code is None or code < 0:
            name = "SIGKILL" if code is None else _signal_name(-code)
            return CrashEvent(self.config, "signal", name, None, detail)
        return CrashEvent(self.config, "exit", None, code, detail)

    def restart(self) -> None:
        """Start a replacement for a crashed worker now, off the next request's path.

        If that fails too, the next request tries again (and reports how it failed).
        """
        with self._lock:
            if self._closed or self._channel is not None:
                return
            self.restarts += 1
            try:
                self._start()
            except Exception as exc:  # noqa: BLE001 - the next request retries and reports
                logger.warning("restarting the worker for %s failed: %s", self.config.key, exc)

    def _stop(self, *, graceful: bool) -> None:
        """End the worker (exit request, then SIGKILL after a grace period)."""
        proc, channel = self._proc, self._channel
        if proc is None:
            return
        if graceful and channel is not None:
            try:
                channel.send({"op": "exit"})
                proc.wait(timeout=_EXIT_GRACE_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if proc.poll() is None:
            _kill(proc)
        self._teardown()

    def _teardown(self) -> None:
        """Close the socket and log of the current worker."""
        if self._channel is not None:
            self._channel.close()
        if self._log_fd >= 0:
            os.close(self._log_fd)
        self._channel, self._proc, self._log_fd = None, None, -1

    def _trim_log(self) -> None:
        """Keep the worker's log small: past `_LOG_LIMIT`, only its last `_LOG_KEEP` bytes.

        Called between requests, while the worker waits for the next one and writes nothing.
        """
        size = os.fstat(self._log_fd).st_size
        if size > _LOG_LIMIT:
            tail = os.pread(self._log_fd, _LOG_KEEP, size - _LOG_KEEP)
            os.ftruncate(self._log_fd, 0)
            os.write(self._log_fd, tail)

    def _log_tail(self) -> str:
        """Return the last non-empty line the worker printed (for the crash report)."""
        if self._log_fd < 0:
            return ""
        size = os.fstat(self._log_fd).st_size
        text = os.pread(self._log_fd, _LOG_TAIL, max(0, size - _LOG_TAIL))
        lines = [line.strip() for line in text.decode(errors="replace").splitlines()]
        return next((line for line in reversed(lines) if line), "")[:300]


def _signal_name(number: int) -> str:
    """Return e.g. "SIGSEGV" for 11, or "signal N" for numbers Python does not know."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _spawn(argv: list[str], options: dict) -> subprocess.Popen:
    """Start a worker from the spawner thread, so its death signal follows this process."""
    future = _SPAWNER.submit(subprocess.Popen, argv, **options)
    try:
        return future.result()
    except BaseException:
        # Interrupted while waiting: the worker may still start; make sure it ends.
        future.add_done_callback(lambda f: f.exception() is None and _kill(f.result()))
        raise


def _kill(proc: subprocess.Popen) -> int | None:
    """SIGKILL a worker and reap it; return its status (None if it will not die)."""
    proc.kill()
    try:
        return proc.wait(timeout=_EXIT_GRACE_S)
    except subprocess.TimeoutExpired:  # stuck in the kernel (D state): nothing more to do
        logger.warning("worker %d survived SIGKILL for %.0f s", proc.pid, _EXIT_GRACE_S)
        return None


def _child_env() -> dict[str, str]:
    """Return the worker's environment: the few variables it needs, plus MNN's own."""
    env = {k: v for k, v in os.environ.items() if k in _ENV_KEEP or k.startswith("MNN_")}
    path = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, path]))
    return env
