"""Stand-in for the MNN worker in tests: confines itself the same way, then tries to escape.

`mnn_tools.run_worker` starts it exactly as it starts the real worker (same environment,
directory, descriptors and limit flags) when a test points ``WORKER_MODULE`` here. It
reports what a hostile converter would find instead of converting anything.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys

from runtime.hardening import confine, is_dumpable


def _attempt(action) -> str:
    """Run `action`; return "ok" or the name of the error that stopped it."""
    try:
        action()
    except OSError as exc:
        return type(exc).__name__
    return "ok"


def _read(path: str) -> None:
    with open(path, "rb") as f:
        f.read()


def _fork() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def main() -> int:
    """Confine, probe, write the findings as the worker's JSON result."""
    parser = argparse.ArgumentParser()
    parser.add_argument("op")
    parser.add_argument("--result-fd", type=int, required=True)
    parser.add_argument("--memory-limit", type=int, required=True)
    parser.add_argument("--cpu-limit", type=int, required=True)
    parser.add_argument("--uid", type=int)
    parser.add_argument("--gid", type=int)
    parser.add_argument("--model-fd", type=int, required=True)
    parser.add_argument("--secret", required=True)
    args = parser.parse_args()
    confinement = confine(
        memory_bytes=args.memory_limit, cpu_seconds=args.cpu_limit, uid=args.uid, gid=args.gid
    )
    findings = {
        "env": sorted(os.environ),
        "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
        "cwd": os.getcwd(),
        # What another process of the child's user could do with the directory.
        "cwd_on_path": any(entry in ("", ".", os.getcwd()) for entry in sys.path),
        "parent_listing": _attempt(lambda: os.listdir(os.path.dirname(os.getcwd()))),
        "secret": _attempt(lambda: _read(args.secret)),
        "model": _attempt(lambda: _read(f"/proc/self/fd/{args.model_fd}")),
        "socket": _attempt(lambda: socket.socket().close()),
        "exec": _attempt(lambda: subprocess.run(["/bin/true"], check=True)),
        "fork": _attempt(_fork),
        "dumpable": is_dumpable(),
        "rlimit_as": resource.getrlimit(resource.RLIMIT_AS)[0],
        "rlimit_cpu": resource.getrlimit(resource.RLIMIT_CPU)[0],
        "rlimit_core": resource.getrlimit(resource.RLIMIT_CORE)[1],
    }
    payload = {"ok": True, "findings": findings, "confinement": confinement.to_dict()}
    os.pwrite(args.result_fd, json.dumps(payload).encode(), 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
