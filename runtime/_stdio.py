"""Capture what native code prints through C stdio, leaving the process's fd 1 alone.

MNN logs with ``printf`` (``MNN_PRINT``/``MNN_ERROR`` on Linux): load errors, "Can't
Find type=3 backend, use 0 instead", a CPU-feature line on import. Those lines must not
reach an app's stdout, yet the app's own output must never be lost or delayed.

Pointing fd 1 at a memfd during a load (the earlier approach) captures everything any
thread writes to fd 1 meanwhile: the app's ``print``, ``os.write(1, ...)``, a subprocess
started then; that output ended up in a debug log instead of on stdout. Re-emitting what
looks like someone else's line would guess at the source of bytes interleaved mid-line,
and reorder them; serialising every writer of fd 1 is impossible from a library.

So on glibc, where C's ``stdout`` is an ordinary assignable ``FILE *`` variable, the
capture swaps that variable for a ``FILE`` writing to a memfd, for the duration of the
block only. ``printf`` reads the variable on every call, so exactly C-stdio output is
captured; Python's ``sys.stdout`` and raw writes to fd 1 never go through C stdio and are
untouched. The one thing still captured that is not MNN's: another thread's *native*
``printf`` during the same short window. Elsewhere (musl declares ``stdout`` const;
Android's MNN logs to logcat, not stdout) the fd-1 redirect remains as the fallback.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

__all__ = ["Captured", "capture_c_stdout", "line_buffer_c_stdout", "memfd", "swaps_file_pointer"]

_IOLBF = 1  # setvbuf's line-buffered mode, on glibc, musl and bionic
_lock = threading.RLock()  # one capture at a time: they share C's stdout
_libc: Any = None


_sink_file: list[tuple[int, int]] = []  # (memfd, FILE *) of the capture stream, made once
_depth = [0]  # captures open on the thread holding _lock (nested ones share the stream)


@dataclass
class Captured:
    """What native code printed inside one capture block (filled in when it exits)."""

    text: str = ""


@contextlib.contextmanager
def capture_c_stdout() -> Iterator[Captured]:
    """Capture C stdio's stdout into memory for the duration of the block."""
    captured = Captured()
    with _lock:
        if swaps_file_pointer():
            sink, stream = _capture_stream()
            _c().fflush(stream)
            start = os.fstat(sink).st_size  # a capture nested in another starts past it
            _depth[0] += 1
            try:
                with _swap_file_pointer(stream):
                    yield captured
            finally:
                _depth[0] -= 1
                captured.text = _drain(sink, stream, start, outermost=_depth[0] == 0)
            return
        sink = memfd("skiff-mnn-log")
        try:
            with _swap_fd1(sink):
                yield captured
        finally:
            captured.text = os.pread(sink, os.fstat(sink).st_size, 0).decode(errors="replace")
            os.close(sink)


def swaps_file_pointer() -> bool:
    """Tell whether captures swap C's ``stdout`` pointer (glibc) instead of fd 1."""
    return _stdout_variable() is not None


def _capture_stream() -> tuple[int, int]:
    """Return the process's capture memfd and the C ``FILE *`` writing to it.

    Made once and never closed: a thread that read C's ``stdout`` just before a capture
    ended may still be inside ``printf`` on this FILE, and at exit glibc flushes every
    FILE it knows. A FILE closed per capture was freed under such a thread (glibc aborts
    with "invalid stdio handle"); one that lives as long as the process cannot be.
    """
    if not _sink_file:
        sink = memfd("skiff-mnn-log")
        # Appending: a printf racing the truncation in `_drain` lands at the new end of
        # the file, never past a hole where the next capture would not look.
        stream = _c().fdopen(fcntl.fcntl(sink, fcntl.F_DUPFD_CLOEXEC, 3), b"a")
        if not stream:
            raise OSError(ctypes.get_errno(), "fdopen failed")
        _sink_file.append((sink, stream))
    return _sink_file[0]


def memfd(name: str, flags: int = 0) -> int:
    """Create a close-on-exec memfd numbered 3 or above.

    In a process whose stdin/stdout/stderr are closed (a daemon), a new descriptor can
    be 0, 1 or 2; capturing MNN's stdout (fd 1) would then clobber it.
    """
    fd = os.memfd_create(name, os.MFD_CLOEXEC | flags)
    if fd > 2:
        return fd
    try:
        return fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    finally:
        os.close(fd)


def _drain(sink: int, stream: int, start: int, *, outermost: bool) -> str:
    """Return what the capture stream got since `start`; empty it if no capture is open."""
    libc = _c()
    libc.fflush(stream)
    text = os.pread(sink, os.fstat(sink).st_size - start, start).decode(errors="replace")
    if outermost:  # the next capture starts from an empty memfd
        os.ftruncate(sink, 0)
    return text


@contextlib.contextmanager
def _swap_file_pointer(stream: int) -> Iterator[None]:
    """Point C's ``stdout`` at `stream`; put the real one back afterwards."""
    variable = _stdout_variable()
    assert variable is not None
    real = variable.value
    variable.value = stream
    try:
        yield
    finally:
        variable.value = real


@contextlib.contextmanager
def _swap_fd1(sink: int) -> Iterator[None]:
    """Point fd 1 itself at `sink` (where C's stdout cannot be swapped); restore it."""
    _flush_all()
    try:
        saved: int | None = os.dup(1)
    except OSError:  # a daemon without stdout: restore that state afterwards
        saved = None
    os.dup2(sink, 1)
    try:
        yield
    finally:
        _flush_all()  # C stdio buffers what was printed: push it into the memfd first
        if saved is None:
            os.close(1)
        else:
            os.dup2(saved, 1)
            os.close(saved)


def line_buffer_c_stdout() -> None:
    """Make C stdout line-buffered, so a native crash loses none of its log lines.

    C stdio fully buffers stdout when it is a file or pipe, as in worker processes: the
    last lines MNN printed before a SIGSEGV, the ones that say what went wrong, would die
    in the buffer. Call it before anything writes to C stdout.
    """
    try:
        libc = _c()
        libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, _IOLBF, 0)
    except (OSError, ValueError, AttributeError):
        pass


_variable: list[ctypes.c_void_p | None] = []  # looked up once


def _stdout_variable() -> ctypes.c_void_p | None:
    """Return glibc's ``stdout`` variable (writable through `.value`), or None elsewhere."""
    if not _variable:
        try:
            glibc = (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
            _variable.append(ctypes.c_void_p.in_dll(_c(), "stdout") if glibc else None)
        except (OSError, ValueError, AttributeError):
            _variable.append(None)
    return _variable[0]


def _c() -> Any:
    """Return libc with the prototypes used here (pointers must not be truncated to int)."""
    global _libc
    if _libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fdopen.restype = ctypes.c_void_p
        libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
        libc.fclose.argtypes = [ctypes.c_void_p]
        libc.fflush.argtypes = [ctypes.c_void_p]
        libc.setvbuf.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
        _libc = libc
    return _libc


def _before_fork() -> None:
    # No capture may be open across a fork: the child would inherit C's stdout pointing
    # at the capture FILE and this lock held by a thread it does not have.
    _lock.acquire()


def _after_fork_in_parent() -> None:
    _lock.release()


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()
    _depth[0] = 0
    # The capture memfd and its FILE are shared with the parent (one file offset, one
    # truncation): the child makes its own on its first capture.
    _sink_file.clear()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


def _flush_all() -> None:
    """Flush Python's and C's stdio buffers so an fd swap splits output at the right place."""
    for stream in (sys.stdout, sys.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.flush()
    with contextlib.suppress(OSError, AttributeError):
        _c().fflush(None)
