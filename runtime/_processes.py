"""Starting and ending worker processes: spawn, kill, environment, signal names.

Workers get a minimal environment (nothing of the app's secrets) and die with this
process: the worker arms ``PR_SET_PDEATHSIG`` itself. The kernel sends that signal when
the *thread* that forked the child exits, so every worker is spawned from one
long-lived thread, never from a short-lived caller thread (a restart's thread, say).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

__all__ = ["EXIT_GRACE_S", "child_env", "kill", "signal_name", "spawn"]

logger = logging.getLogger("runtime")

EXIT_GRACE_S = 5.0
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)
# What a worker inherits: enough to start Python and MNN, nothing of the app's secrets.
# LD_LIBRARY_PATH: embedded interpreters (e.g. on Android) may need it to start at all.
_ENV_KEEP = ("PATH", "HOME", "LANG", "LC_ALL", "LC_CTYPE", "PYTHONHOME", "LD_LIBRARY_PATH")
# Never shut down: its thread must outlive every worker (see the module docstring).
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skiff-worker-spawner")


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
