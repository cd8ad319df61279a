"""`skiff ...` that SIGKILLs itself at a chosen instant: a power cut, for fault tests.

SKIFF_TEST_CRASH=download:BYTES  mid-download, after BYTES reach the disk (the last
                                 write cut short, as a crash mid-write leaves it)
SKIFF_TEST_CRASH=chunk:N         writing the Nth chunk fetched (from 1), half of it written
SKIFF_TEST_CRASH=rename          the artifact downloaded whole, before its rename
SKIFF_TEST_CRASH=self-test       after the download, before the self-test
SKIFF_TEST_CRASH=pointer:before:V  activating version V: new pointer written and
SKIFF_TEST_CRASH=pointer:after:V   fsynced, before (after) its rename

python -m tests.device_agent.crash_agent agent run --once ...
"""

from __future__ import annotations

import json
import os
import signal
import sys

import device_agent.chunk_store as chunk_store
import device_agent.download as download
import device_agent.install as install
import device_agent.state as state
from control_plane.cli.main import main


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _arm(point: str) -> None:
    kind, _, arg = point.partition(":")
    if kind == "download":
        limit, written = int(arg), [0]
        real = download.write_all

        def write_all(fd: int, data: bytes) -> None:
            if written[0] + len(data) > limit:
                os.write(fd, bytes(data[: limit - written[0]]))
                _die()
            written[0] += len(data)
            real(fd, data)

        download.write_all = write_all
    elif kind == "chunk":
        nth, count = int(arg), [0]
        real_chunk_write = chunk_store.write_all

        def write_chunk(fd: int, data: bytes) -> None:
            count[0] += 1
            if count[0] == nth:
                os.write(fd, bytes(data[: len(data) // 2]))
                _die()
            real_chunk_write(fd, data)

        chunk_store.write_all = write_chunk
    elif kind == "rename":
        download.Downloads._keep = lambda self, part, final: _die()
    elif kind == "self-test":
        install.Installer._self_test_blocking = lambda self, *args: _die()
    elif kind == "pointer":
        when, version = arg.split(":")
        real_replace = os.replace

        def atomic_write(path, data: bytes, mode: int = 0o600) -> None:
            body = json.loads(data) if path.parent.name == "models" else {}
            if (body.get("active") or {}).get("version") != int(version):
                return real_atomic(path, data, mode)
            tmp = path.with_name(f".{path.name}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
            state.write_all(fd, data)
            os.fsync(fd)
            os.close(fd)
            if when == "after":
                real_replace(tmp, path)
            _die()

        real_atomic = state.atomic_write
        state.atomic_write = atomic_write
    else:
        raise SystemExit(f"unknown crash point {point!r}")


if __name__ == "__main__":
    _arm(os.environ["SKIFF_TEST_CRASH"])
    sys.argv = ["skiff", *sys.argv[1:]]
    sys.exit(main())
