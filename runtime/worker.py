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

A worker can also die between requests (the OOM killer picks idle processes too). Each
request checks first that its worker is alive; a dead one is replaced transparently: it
is reported (``on_idle_death``) but never counted as a crash, since no request was lost.

Every wait is bounded. A request waits for its turn (behind another request, or a
restart) at most its deadline, then fails with DeadlineExceeded, and runs at most its
deadline (then the worker is killed: WorkerCrashed). Restarts load the new worker
without holding the request lock, in a thread of their own, so a slow restart (a big
model, GPU tuning) never blocks anyone beyond their deadline; ``restart()`` waits for
it at most the load deadline.

Detection never depends on timing: a dead child closes its end of the socket, so the
blocked read returns EOF at once, and ``wait()`` reports the signal. A request that is
interrupted midway (KeyboardInterrupt, a signal handler's exception) kills the worker
too: its reply would otherwise be read as the answer to the next request.

A batch (`run_batch`) goes to the worker as one request; the worker answers its items
in frames as they finish (at least every few milliseconds), and each wait for the next
frame is bounded by the deadline as one request is, so a long batch is never mistaken
for a hung worker, and a hung one is still killed at its deadline.

Workers get a minimal environment and die with this process (see `runtime._processes`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import select
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

import runtime._processes as _processes
import runtime._wire as _wire
from runtime._processes import EXIT_GRACE_S, child_env, kill, signal_name
from runtime.backends import Backend, BackendConfig
from runtime.errors import (
    BackendUnavailable,
    DeadlineExceeded,
    ExecutorClosed,
    InferenceError,
    InvalidInput,
    ModelLoadError,
    RuntimeFailure,
    WorkerCrashed,
)
from runtime.events import CrashEvent
from runtime.signature import Signature

__all__ = ["DEFAULT_DEADLINE_S", "Fault", "WorkerExecutor", "prewarm_worker"]

logger = logging.getLogger("runtime")

DEFAULT_DEADLINE_S = 10.0
LOAD_DEADLINE_S = 300.0  # loading (and GPU kernel tuning) of a big model is slow
_MODULE = "runtime._worker_main"
_LOG_TAIL = 4096
_LOG_LIMIT, _LOG_KEEP = 64 * 1024, 32 * 1024  # past the limit, only the last part is kept
_BATCH_ITEMS, _BATCH_ARRAYS = 256, 512  # the most items, and input arrays, one request carries
_ASYNC_BYTES = 1 << 20  # larger inputs go through `run` in a thread: sending them may block


def prewarm_worker() -> None:
    """Start a worker now, for the next `WorkerExecutor` to take instead of a cold one.

    For a model still on its way (downloading, decrypting): the worker's Python and MNN
    start meanwhile. Unused, it ends after `runtime._processes.WARM_IDLE_S`.
    """
    _processes.prewarm(_MODULE)


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
        on_idle_death: Callable[[CrashEvent], None] | None = None,
    ) -> None:
        """Start a worker and load the model in it with `config`.

        Raises BackendUnavailable or ModelLoadError like `InProcessExecutor`, and
        WorkerCrashed if the worker dies while loading. `on_idle_death` is told about
        workers found dead between requests (and replaced).
        """
        self.config = config
        self.deadline_s = deadline_s
        self._model_fd, self._fault = model_fd, fault
        self._on_idle_death = on_idle_death
        # Held by a request for its round trip (bounded by the deadline), and briefly for
        # state changes; never while a restart loads (`_restarting` keeps requests off).
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a restart finished, or closed
        self._restarting = False
        self._restart_error: Exception | None = None
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
        """Run validated inputs in the worker; see `InProcessExecutor.run`.

        Raises DeadlineExceeded if no live worker was free within the deadline, and
        ModelLoadError if the worker was down and restarting it failed.
        """
        deadline = time.monotonic() + self.deadline_s
        if not self._lock.acquire(timeout=self.deadline_s):
            raise DeadlineExceeded(self._late("requests ahead of this one held it"))
        try:
            self._await_worker(deadline)
            names = self.signature.input_names
            request = {"op": "run", "exact": exact}
            reply, outputs = self._call(request, dict(zip(names, arrays, strict=True)))
            self._trim_log()
        finally:
            self._lock.release()
        return self._outputs(reply, outputs)

    async def run_async(
        self, arrays: Sequence[np.ndarray], exact: bool
    ) -> dict[str, np.ndarray] | None:
        """`run` for a caller on an asyncio loop: the round trip waits on the loop, no thread.

        Returns None, having done nothing, when the request cannot go at once (another
        request or a restart has the worker, it is down or closed, the inputs are large):
        the caller then runs `run` in a thread, which waits its turn. A whole reply is
        read on the loop; a partial one, or none by the deadline, is waited for in a
        thread. A caller cancelled midway leaves its reply to a thread to read and drop:
        the worker stays up, and the next request cannot take that reply for its own.
        """
        if sum(a.nbytes for a in arrays) > _ASYNC_BYTES or not self._lock.acquire(False):
            return None
        owner = True  # this coroutine releases the lock, unless a thread took the request
        try:
            if self._closed or self._restarting or self._channel is None or self._proc is None:
                return None
            if not self._idle_and_alive():
                return None  # `run` reports and replaces it
            deadline = time.monotonic() + self.deadline_s
            names = self.signature.input_names
            request = {"op": "run", "exact": exact}
            seq = self._send(request, dict(zip(names, arrays, strict=True)))
            try:
                ready = await _readable(self._channel.sock, deadline)
            except asyncio.CancelledError:
                owner = False
                threading.Thread(target=self._finish, args=(seq, deadline), daemon=True).start()
                raise
            if ready and self._channel.frame_ready():
                reply, outputs = self._replies(seq, deadline)
                self._trim_log()
            else:
                owner = False
                loop = asyncio.get_running_loop()
                reply, outputs = await loop.run_in_executor(None, self._finish, seq, deadline)
        finally:
            if owner:
                self._lock.release()
        return self._outputs(reply, outputs)

    def _finish(self, seq: int, deadline: float) -> tuple[dict, dict[str, np.ndarray]]:
        """Read the reply to request `seq` (sent by `run_async`), then let go of the lock."""
        try:
            reply, outputs = self._replies(seq, deadline)
            self._trim_log()
            return reply, outputs
        finally:
            self._lock.release()

    def _outputs(self, reply: dict, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Return a run's outputs from its reply, or raise the error it reports."""
        if not reply.get("ok"):
            kind, error = reply.get("kind"), str(reply.get("error", "worker error"))
            raise InvalidInput(error) if kind == "invalid_input" else InferenceError(error)
        if list(outputs) != list(self.signature.outputs):
            expected = list(self.signature.outputs)
            raise InferenceError(f"worker returned outputs {list(outputs)}, not {expected}")
        return outputs

    def run_batch(
        self, items: Sequence[tuple[Sequence[np.ndarray], bool]]
    ) -> list[dict[str, np.ndarray] | RuntimeFailure]:
        """Run several validated inputs (arrays, exact) in one round trip to the worker.

        (One per `_BATCH_ITEMS` items, all in one turn on the worker.) Returns, per item
        and in order, its outputs, or the InvalidInput or InferenceError that `run`
        would raise for it alone. If the worker dies (or
        misses the deadline between two of its answers), the items it had not answered
        get the same WorkerCrashed. Raises DeadlineExceeded and ModelLoadError as `run`.
        """
        if not items:
            return []
        deadline = time.monotonic() + self.deadline_s
        if not self._lock.acquire(timeout=self.deadline_s):
            raise DeadlineExceeded(self._late("requests ahead of this one held it"))
        answers: list[dict[str, np.ndarray] | RuntimeFailure | None] = [None] * len(items)
        try:
            self._await_worker(deadline)
            names = self.signature.input_names
            # Bounded frames: a header of a few KiB, and far fewer buffers than IOV_MAX.
            step = max(1, min(_BATCH_ITEMS, _BATCH_ARRAYS // max(len(names), 1)))
            for start in range(0, len(items), step):
                chunk = items[start : start + step]
                arrays = {}
                for i, (inputs, _) in enumerate(chunk):
                    for name, array in zip(names, inputs, strict=True):
                        arrays[f"{i}/{name}"] = array
                request = {"op": "run_batch", "exact": [bool(exact) for _, exact in chunk]}
                got: list = [None] * len(chunk)
                try:
                    self._call(request, arrays, until=functools.partial(self._answered, got))
                except WorkerCrashed as exc:
                    got = [exc if a is None else a for a in got]
                    answers[start:] = got + [exc] * (len(items) - start - len(got))
                    break
                answers[start : start + len(chunk)] = got
            else:
                self._trim_log()
        finally:
            self._lock.release()
        return answers  # type: ignore[return-value] - every item is answered by now

    def _answered(self, answers: list, header: dict, arrays: dict[str, np.ndarray]) -> bool:
        """Take one frame of a batch's answers; tell whether every item has its answer.

        ProtocolError (the worker is not to be trusted) for an index out of range or
        answered twice.
        """
        items = header.get("items")
        if not header.get("ok") or not isinstance(items, list):
            raise _wire.ProtocolError(f"bad batch answer: {str(header)[:200]}")
        outputs = self.signature.outputs
        shared = len(items) > 1  # one buffer under all: copy, so each item owns its own
        for item in items:
            if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int):
                raise _wire.ProtocolError("bad batch answer item")
            index, kind, error = item
            if not 0 <= index < len(answers) or answers[index] is not None:
                raise _wire.ProtocolError(f"batch answer for item {index} out of place")
            if kind == "invalid_input":
                answers[index] = InvalidInput(str(error))
            elif kind:
                answers[index] = InferenceError(str(error))
            else:
                got = [arrays.get(f"{index}/{name}") for name in outputs]
                if any(a is None for a in got):
                    answers[index] = InferenceError(f"worker returned no outputs {outputs}")
                else:
                    pairs = zip(outputs, got, strict=True)
                    answers[index] = {n: a.copy() if shared else a for n, a in pairs}
        return all(a is not None for a in answers)

    def close(self) -> None:
        """Stop the worker: ask it to exit, then kill it if it does not.

        A worker still being started by a restart is stopped when that restart ends.
        """
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            if not self._restarting:
                self._stop(graceful=True)

    def _await_worker(self, deadline: float) -> None:
        """Return once a live worker is up; the caller holds the lock (released to wait).

        A worker found dead here died between requests: it is reaped, reported and
        replaced, and this request waits for the replacement like any other.
        """
        waited = False
        while not self._closed:
            if not self._restarting:
                if self._channel is not None and self._proc is not None:
                    if self._idle_and_alive():
                        return
                    self._note_idle_death(self._reap("died"))
                elif waited and self._restart_error is not None:
                    error = self._restart_error
                    if isinstance(error, WorkerCrashed):  # the replacement died loading:
                        raise WorkerCrashed(error.event)  # a crash, counted like any other
                    raise ModelLoadError(str(error))  # MNN refused to load it again
                self._begin_restart()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DeadlineExceeded(self._late("it was restarting"))
            self._changed.wait(remaining)
            waited = True
        raise ExecutorClosed(f"executor for {self.config.key} is closed")

    def _idle_and_alive(self) -> bool:
        """Tell whether the worker between requests is alive (two syscalls, no waiting).

        A worker whose process is reapable is dead; so is one whose socket is readable:
        an idle worker never writes, so that is the EOF of a dying process (its threads
        may still be exiting, which keeps it from being reaped for a moment).
        """
        assert self._proc is not None and self._channel is not None
        if self._proc.poll() is not None:
            return False
        poller = select.poll()
        poller.register(self._channel.sock, select.POLLIN | select.POLLHUP)
        return not poller.poll(0)

    def _note_idle_death(self, event: CrashEvent) -> None:
        """Report a worker that died between requests (not a crash: no request was lost)."""
        event = dataclasses.replace(event, count=0, idle=True)
        logger.warning("%s; restarting it", event.describe())
        if self._on_idle_death is not None:
            self._on_idle_death(event)

    def _late(self, why: str) -> str:
        """Explain a DeadlineExceeded."""
        return f"no turn on the worker for {self.config.key} within {self.deadline_s:g} s: {why}"

    def _start(self) -> None:
        """Spawn a worker and load the model; leaves it down if anything fails."""
        self._spawn()
        try:
            self._load()
        except BaseException as exc:
            self._stop(graceful=isinstance(exc, RuntimeFailure))  # no-op if reaped already
            raise

    def _child(self) -> tuple[str, list[str], tuple[int, ...], dict[str, str]]:
        """Return the child's module, its own arguments, the fds it inherits, its env."""
        fds = (self._model_fd,)
        return _MODULE, ["--model-fd", str(self._model_fd)], fds, child_env()

    def _spawn(self) -> None:
        """Start the worker process (or take a prewarmed one), with its socket and log memfd."""
        module, extra, fds, env = self._child()
        fault = self._fault.arg() if self._fault is not None else None
        started = _processes.start(module, extra, fds, env, fault=fault)
        self._proc, self._channel = started.proc, _wire.Channel(started.sock)
        self._log_fd = started.log_fd

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
        until: Callable[[dict, dict[str, np.ndarray]], bool] | None = None,
    ) -> tuple[dict, dict[str, np.ndarray]]:
        """Send one request and wait for its reply; on death or timeout, reap and raise.

        With `until`, replies are read until `until(header, arrays)` says that was the
        last, each within the deadline of the one before.
        """
        budget = deadline_s or self.deadline_s
        deadline = time.monotonic() + budget
        seq = self._send(header, arrays)
        return self._replies(seq, deadline, budget, until)

    def _send(self, header: dict, arrays: dict | None) -> int:
        """Send one request; return its sequence number (on failure, reap and raise)."""
        assert self._channel is not None
        self._seq = seq = (self._seq + 1) & 0xFFFF_FFFF
        with self._guard():
            self._channel.send(header, arrays, seq=seq)
        return seq

    def _replies(
        self,
        seq: int,
        deadline: float,
        budget: float = 0.0,
        until: Callable[[dict, dict[str, np.ndarray]], bool] | None = None,
    ) -> tuple[dict, dict[str, np.ndarray]]:
        """Read the reply to request `seq` (see `_call`); on death or timeout, reap and raise."""
        assert self._channel is not None
        with self._guard():
            while True:
                reply = self._channel.recv(deadline=deadline)
                if reply.seq != seq:  # cannot happen unless the worker is confused or hostile
                    raise _wire.ProtocolError(f"reply to request {reply.seq}, not {seq}")
                if until is None or until(reply.header, reply.arrays):
                    return reply.header, reply.arrays
                deadline = time.monotonic() + budget

    @contextlib.contextmanager
    def _guard(self) -> Iterator[None]:
        """Turn a failed exchange with the worker into WorkerCrashed, the worker reaped."""
        try:
            yield
            return
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
                code = proc.wait(timeout=EXIT_GRACE_S)
            except subprocess.TimeoutExpired:  # closed the socket yet lives on: end it
                pass
        if code is None:  # still alive: hung, talking nonsense, or interrupted
            code = kill(proc)
        detail = detail or self._log_tail()
        self._teardown()
        if how != "died":
            return CrashEvent(self.config, how, "SIGKILL", None, detail)
        if code is None or code < 0:
            name = "SIGKILL" if code is None else signal_name(-code)
            return CrashEvent(self.config, "signal", name, None, detail)
        return CrashEvent(self.config, "exit", None, code, detail)

    def restart(self) -> None:
        """Start a replacement for a crashed worker now, off the next request's path.

        Joins a restart already under way; waits at most the load deadline. If the
        restart fails, the next request tries again (and reports how it failed).
        """
        with self._lock:
            if self._closed or (self._channel is not None and not self._restarting):
                return
            self._begin_restart()
            bound = LOAD_DEADLINE_S + 2 * EXIT_GRACE_S
            self._changed.wait_for(lambda: not self._restarting, timeout=bound)

    def _begin_restart(self) -> None:
        """Start a restart in its own thread, unless one runs; the caller holds the lock."""
        if self._restarting or self._closed:
            return
        self._restarting, self._restart_error = True, None
        self.restarts += 1
        name = f"skiff-worker-restart-{self.config.key}"
        threading.Thread(target=self._restart_body, name=name, daemon=True).start()

    def _restart_body(self) -> None:
        """Spawn and load a new worker (without the lock), then let the waiters in."""
        error: Exception | None = None
        try:
            self._start()  # only this thread touches the worker while _restarting is set
        except Exception as exc:  # noqa: BLE001 - waiting requests report it
            error = exc
            logger.warning("restarting the worker for %s failed: %s", self.config.key, exc)
        finally:
            with self._lock:
                self._restarting, self._restart_error = False, error
                if self._closed:
                    self._stop(graceful=True)
                self._changed.notify_all()

    def _stop(self, *, graceful: bool) -> None:
        """End the worker (exit request, then SIGKILL after a grace period)."""
        proc, channel = self._proc, self._channel
        if proc is None:
            return
        if graceful and channel is not None:
            try:
                channel.send({"op": "exit"})
                proc.wait(timeout=EXIT_GRACE_S)
            except (OSError, subprocess.TimeoutExpired):
                pass
        if proc.poll() is None:
            kill(proc)
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


async def _readable(sock: socket.socket, deadline: float) -> bool:
    """Wait on the running loop until `sock` is readable (True) or the deadline passed."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()

    def settle(value: bool) -> None:
        if not ready.done():
            ready.set_result(value)

    fd = sock.fileno()
    loop.add_reader(fd, settle, True)
    timer = loop.call_at(loop.time() + max(0.0, deadline - time.monotonic()), settle, False)
    try:
        return await ready
    finally:
        timer.cancel()
        loop.remove_reader(fd)
