"""Starting and ending worker processes: spawn, kill, environment, signal names.

Workers get a minimal environment (nothing of the app's secrets) and die with this
process: the worker arms ``PR_SET_PDEATHSIG`` itself. The kernel sends that signal when
the *thread* that forked the child exits, so every worker is spawned from one
long-lived thread, never from a short-lived caller thread (a restart's thread, say).

A worker can be started before its model exists (`prewarm`): Python and MNN are imported
while, say, the model still downloads, and the next `start` of that module takes it and
hands it the model's descriptors over the socket (``SCM_RIGHTS``) instead of starting a
process cold. One waits per module at most, and only `WARM_IDLE_S`: it holds memory.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from runtime._stdio import memfd

__all__ = [
    "EXIT_GRACE_S",
    "WARM_IDLE_S",
    "Started",
    "child_env",
    "discard_warm",
    "kill",
    "prewarm",
    "signal_name",
    "spawn",
    "start",
]

logger = logging.getLogger("runtime")

EXIT_GRACE_S = 5.0
WARM_IDLE_S = 120.0  # a prewarmed worker nobody took by then is ended
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
# What a worker inherits: enough to start Python and MNN, nothing of the app's secrets.
# LD_LIBRARY_PATH: embedded interpreters (e.g. on Android) may need it to start at all.
_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONHOME", "LD_LIBRARY_PATH")
# Never shut down: its thread must outlive every worker (see the module docstring).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skiff-worker-spawner")
# module -> the worker started ahead for it, and its environment
_warm: dict[str, tuple[Started, dict[str, str]]] = {}
_warm_lock = threading.Lock()


def signal_name(number: int) -> str:
    """Return e.g. "SIGSEGV" for 11, or "signal N" for numbers Python does not know."""
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def spawn(argv: list[str], options: dict) -> subprocess.Popen:
    """Start a worker from the spawner thread, so its death signal follows this process."""
    future = _SPAWNER.submit(subprocess.Popen, argv, **options)
    try:
        return future.result()
    except BaseException:
        # Interrupted while waiting: the worker may still start; make sure it ends.
        future.add_done_callback(lambda f: f.exception() is None and kill(f.result()))
        raise


def kill(proc: subprocess.Popen) -> int | None:
    """SIGKILL a worker and reap it; return its status (None if it will not die)."""
    proc.kill()
    try:
        return proc.wait(timeout=EXIT_GRACE_S)
    except subprocess.TimeoutExpired:  # stuck in the kernel (D state): nothing more to do
        logger.warning("worker %d survived SIGKILL for %.0f s", proc.pid, EXIT_GRACE_S)
        return None


def child_env() -> dict[str, str]:
    """Return the worker's environment: the few variables it needs, plus MNN's own."""
    env = {k: v for k, v in os.environ.items() if k in _ENV_KEEP or k.startswith("MNN_")}
    path = os.environ.get("PYTHONPATH")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, path]))
    return env


@dataclass(frozen=True)
class Started:
    """A worker process, the parent's end of its socket, and the memfd of its log."""

    proc: subprocess.Popen
    sock: socket.socket
    log_fd: int

    def discard(self) -> None:
        """End the process and close what the parent holds of it."""
        if self.proc.poll() is None:
            kill(self.proc)
        self.sock.close()
        os.close(self.log_fd)


def start(
    module: str,
    args: list[str],
    fds: tuple[int, ...],
    env: dict[str, str],
    *,
    fault: str | None = None,
) -> Started:
    """Start a worker running `module` with `args`, inheriting `fds`; or take a warm one.

    A worker `prewarm`ed for `module` (with the same `env`) is given `fds` over its socket
    instead; `args`, which name those descriptors, are not needed then. `fault` (tests
    only) always starts one afresh.
    """
    if fault is None:
        warm = _take_warm(module, fds, env)
        if warm is not None:
            return warm
    extra = [*args, "--fault", fault] if fault is not None else args
    return _start(module, extra, fds, env)


def prewarm(module: str) -> None:
    """Start a worker of `module` now for the next `start` to take (no-op if one waits).

    Its model comes later, over the socket: the worker imports what it needs meanwhile.
    """
    with _warm_lock:
        waiting = _warm.get(module)
        if waiting is not None and waiting[0].proc.poll() is None:
            return
    env = child_env()
    started = _start(module, ["--warm"], (), env)
    with _warm_lock:
        old, _warm[module] = _warm.get(module), (started, env)
    if old is not None:
        old[0].discard()
    timer = threading.Timer(WARM_IDLE_S, _expire, (module, started))
    timer.daemon = True
    timer.start()


def _take_warm(module: str, fds: tuple[int, ...], env: dict[str, str]) -> Started | None:
    """Take the worker prewarmed for `module` and send it `fds` (None if none fits)."""
    with _warm_lock:
        waiting = _warm.get(module)
        if waiting is None or waiting[1] != env:
            return None
        warm = _warm.pop(module)[0]
    try:
        if warm.proc.poll() is not None:
            raise OSError("the prewarmed worker died")
        socket.send_fds(warm.sock, [b"F"], list(fds))
    except OSError:
        warm.discard()
        return None
    return warm


def discard_warm() -> None:
    """End every prewarmed worker still waiting to be taken (a later `start` spawns afresh)."""
    with _warm_lock:
        left = [started for started, _ in _warm.values()]
        _warm.clear()
    for started in left:
        started.discard()


def _expire(module: str, started: Started) -> None:
    """End a prewarmed worker still waiting to be taken."""
    with _warm_lock:
        if _warm.get(module, (None,))[0] is not started:
            return
        del _warm[module]
    started.discard()


def _start(module: str, args: list[str], fds: tuple[int, ...], env: dict[str, str]) -> Started:
    """Start `module` connected by a fresh socketpair, its output to a fresh log memfd."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    log_fd = memfd("skiff-worker-log")
    # Shared with the worker's stdout and stderr: appending, they keep writing at the
    # end after the log is trimmed, instead of past a hole.
    fcntl.fcntl(log_fd, fcntl.F_SETFL, fcntl.fcntl(log_fd, fcntl.F_GETFL) | os.O_APPEND)
    argv = [sys.executable, "-m", module, "--parent-pid", str(os.getpid())]
    argv += ["--sock-fd", str(child.fileno()), *args]
    options = {
        "stdin": subprocess.DEVNULL,
        "stdout": log_fd,
        "stderr": log_fd,
        "pass_fds": (child.fileno(), *fds),
        "env": env,
        "start_new_session": True,  # Ctrl-C in the app's terminal is not for us
    }
    try:
        proc = spawn(argv, options)
    except BaseException:
        parent.close()
        os.close(log_fd)
        raise
    finally:
        child.close()
    return Started(proc, parent, log_fd)
