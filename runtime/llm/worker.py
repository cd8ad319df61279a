"""`LlmWorker`: an `LlmSession` in a child process, so a native crash in MNN-LLM is contained.

The child (`runtime.llm._worker_main`) inherits the bundle's sealed memfds (same
descriptor numbers), makes its own `BundleDir` of ``/proc/self/fd/N`` symlinks (they
resolve per process, so the parent's directory would be of no use to it) and loads an
`LlmSession`. Everything but the model runs in the parent, on the building blocks of the
tensor-model worker (`runtime.worker.WorkerExecutor`): `runtime._wire` frames over a Unix
socketpair, a minimal environment, the log memfd whose last line goes into crash
reports, kill-and-reap with signal names, restarts in a thread of their own, and every
wait bounded.

A generation streams: the child sends one frame per model step (a text delta, or an
empty "tick" when a step produced no text: a held-back stop string, half a UTF-8
character), then an "end" frame with the `Summary`. The parent waits at most
``step_deadline_s`` for each frame, so a hung step is killed (`WorkerCrashed`, reason
"deadline") however long the answer is. Cancelling writes the request's sequence number
into a small shared memfd that the child reads before every step (a memory read, no
syscall); a stale number left over from a finished request never matches the next one.
A consumer that stops iterating (closing the generator, or dropping it) cancels the same
way, and the parent reads the stream to its end, so the worker is in step for the next
request.

One request at a time, as in `WorkerExecutor`: a caller waits for its turn (behind a
generation, or a restart) at most ``queue_deadline_s``, then gets `DeadlineExceeded`. A
generation holds the turn from its first ``next()`` until its last frame, so a consumer
must iterate to the end or close the generator (CPython closes a dropped one at once).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import os
import shutil
import struct
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

import runtime._wire as _wire
from runtime._processes import child_env
from runtime._stdio import memfd
from runtime.backends import Backend, BackendConfig
from runtime.errors import (
    DeadlineExceeded,
    ExecutorClosed,
    InferenceError,
    InvalidInput,
    ModelLoadError,
    WorkerCrashed,
)
from runtime.events import CrashEvent
from runtime.llm.bundle import BundleInfo, validate_bundle
from runtime.llm.session import (
    _MEMORY,
    _PRECISIONS,
    Delta,
    LlmSession,
    Sampling,
    StopReason,
    Summary,
    _is_int,
)
from runtime.worker import Fault, WorkerExecutor

__all__ = ["LlmWorker"]

logger = logging.getLogger("runtime")

_FLAG = struct.Struct("<I")  # the shared cancel flag: the sequence number to stop


class LlmWorker:
    """An MNN-LLM bundle served by a child process that may crash. Thread-safe."""

    def __init__(
        self,
        files: Mapping[str, int],
        *,
        threads: int = 1,
        precision: str = "low",
        memory: str = "low",
        load_deadline_s: float = 300.0,
        step_deadline_s: float = 30.0,
        queue_deadline_s: float = 60.0,
        clock: Callable[[], float] = time.perf_counter,
        fault: Fault | None = None,
        on_idle_death: Callable[[CrashEvent], None] | None = None,
    ) -> None:
        """Validate the bundle in `files` (name -> sealed memfd) here, then load it in a child.

        The worker keeps its own duplicates of the descriptors (a restart passes them
        again) and closes them with itself: the caller may close its own at once.
        `threads`, `precision` and `memory` are MNN's CPU settings, as for
        `LlmSession`. Raises InvalidBundle for a bundle Skiff refuses,
        InvalidInput for bad settings, ModelLoadError (with MNN's last log line) when MNN
        cannot load it, and WorkerCrashed when the child dies while loading (or takes
        longer than `load_deadline_s`). `step_deadline_s` bounds each model step of a
        request (a long prompt's prefill is one step); `queue_deadline_s` bounds the wait
        for a turn behind another request or a restart. `fault` is
        a test hook (see `runtime.worker.Fault`): for this worker, `on_request` counts
        model steps of the child process. `clock` times the parent's view of a request
        (the summary's ``ttft_s``).
        """
        _check_settings(threads, precision, memory)
        self.info: BundleInfo = validate_bundle(files)
        threads = int(threads)  # a numpy integer is fine, but not on the wire
        config = BackendConfig(Backend.CPU, precision, threads, memory)
        self._clock = clock
        self._files = {name: os.dup(fd) for name, fd in files.items()}
        try:
            self._worker = _LlmProcess(
                self._files,
                {"threads": threads, "precision": precision, "memory": memory},
                config,
                load_deadline_s=load_deadline_s,
                step_deadline_s=step_deadline_s,
                queue_deadline_s=queue_deadline_s,
                fault=fault,
                on_idle_death=on_idle_death,
            )
            # Checks arguments exactly as an in-process session does (same errors, same
            # messages); its engine forwards the little it runs (encode, chat) to the child.
            remote = _RemoteEngine(self._worker)
            self._front = LlmSession.from_engine(
                remote, self.info, stop_token_ids=self._worker.stop_token_ids, clock=clock
            )
            self.context_length: int = self._front.context_length
        except BaseException:
            self._close_files()
            raise

    @property
    def pid(self) -> int | None:
        """Return the child's process id (None while it is down)."""
        return self._worker.pid

    @property
    def restarts(self) -> int:
        """Return how many times the child was replaced."""
        return self._worker.restarts

    @property
    def config(self) -> BackendConfig:
        """Return the settings as a backend config (what crash events name)."""
        return self._worker.config

    def encode(self, text: str) -> list[int]:
        """Tokenize raw text (no chat template) in the child; see `LlmSession.encode`."""
        return self._front.encode(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> str:
        """Render chat messages with the bundle's template; see `LlmSession.apply_chat_template`."""
        return self._front.apply_chat_template(messages)

    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int,
        sampling: Sampling | None = None,
        stop_strings: Sequence[str] = (),
        cancelled: Callable[[], bool] = lambda: False,
    ) -> Iterator[Delta]:
        """Generate in the child, streaming its text deltas; see `LlmSession.generate`.

        Arguments are checked here, before anything runs (InvalidInput). `cancelled()`
        is checked between frames; once true, the child stops within a step and the
        last delta's summary says CANCELLED. The summary's ``ttft_s`` is measured here
        (it includes the hop to the child); its throughputs are the child's. Raises
        WorkerCrashed if the child dies or misses the step deadline (the next request
        restarts it), DeadlineExceeded if no turn came within the queue deadline.
        """
        sampling = Sampling() if sampling is None else sampling
        checked = self._front.generate(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            sampling=sampling,
            stop_strings=stop_strings,
        )
        checked.close()  # never started: it only proved the arguments sound
        header = {
            "op": "generate",
            "max_new_tokens": int(max_new_tokens),
            "sampling": dataclasses.asdict(sampling),
            "stop_strings": list(stop_strings),
        }
        ids = np.asarray([int(t) for t in prompt_ids], dtype=np.int64)
        return self._worker.stream(header, {"ids": ids}, cancelled, self._clock)

    def logits(self, prompt_ids: Sequence[int], continuation_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits computed in the child; see `LlmSession.logits`.

        Each model step gets the step deadline (the prompt's prefill, then one per
        continuation token).
        """
        prompt = _token_list(prompt_ids, "prompt_ids")
        rest = _token_list(continuation_ids, "continuation_ids")
        header = {"op": "logits", "prompt": prompt, "continuation": rest}
        _, arrays = self._worker.request(header, steps=1 + len(rest))
        rows = arrays.get("logits")
        if rows is None or rows.dtype != np.float32 or rows.ndim != 2 or len(rows) != len(rest):
            raise InferenceError("the worker sent malformed logits")
        return rows

    def restart(self) -> None:
        """Start a replacement for a crashed child now (the next request would anyway)."""
        self._worker.restart()

    def close(self) -> None:
        """Stop the child: cancel what runs, ask it to exit, kill it if it does not. Idempotent."""
        self._worker.close()
        self._close_files()

    def _close_files(self) -> None:
        files, self._files = self._files, {}
        for fd in files.values():
            os.close(fd)

    def __enter__(self) -> LlmWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _RemoteEngine:
    """The `Engine` of the parent's argument-checking session: text work goes to the child."""

    def __init__(self, worker: _LlmProcess) -> None:
        self._worker = worker
        self.vocab_size = worker.vocab_size

    def encode(self, text: str) -> list[int]:
        reply, _ = self._worker.request({"op": "encode", "text": text})
        ids = reply.get("ids")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise InferenceError("the worker sent malformed token ids")
        return ids

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        reply, _ = self._worker.request({"op": "chat", "messages": [dict(m) for m in messages]})
        text = reply.get("text")
        if not isinstance(text, str):
            raise InferenceError("the worker sent a malformed chat rendering")
        return text

    def token_bytes(self, token: int) -> bytes:
        raise AssertionError("generation runs in the worker")

    def forward(self, ids: Sequence[int]) -> np.ndarray:
        raise AssertionError("generation runs in the worker")

    def reset(self) -> None:
        raise AssertionError("generation runs in the worker")

    def close(self) -> None:
        pass


class _LlmProcess(WorkerExecutor):
    """The child process and its protocol: `WorkerExecutor`'s lifecycle, LLM requests.

    Inherits spawning-thread rules, idle-death checks, reaping, background restarts,
    log trimming and the crash report; replaces the model-specific spawn and load, and
    adds streaming. ``_active`` marks a generation that owns the worker between frames
    (the lock itself is held only for one frame's round trip, so `close()` is never
    stuck behind a consumer that stopped iterating).
    """

    def __init__(
        self,
        files: dict[str, int],
        settings: dict[str, Any],
        config: BackendConfig,
        *,
        load_deadline_s: float,
        step_deadline_s: float,
        queue_deadline_s: float,
        fault: Fault | None,
        on_idle_death: Callable[[CrashEvent], None] | None,
    ) -> None:
        self._files, self._settings = files, settings
        self.load_deadline_s, self.queue_deadline_s = load_deadline_s, queue_deadline_s
        self._active: int | None = None
        self.vocab_size, self.stop_token_ids, self.load_ms = 0, (), 0.0
        # The cancel flag, shared with every child of this worker (sequence numbers keep
        # growing across restarts, so a flag left set never matches a later request).
        self._flag_fd = memfd("skiff-llm-cancel")
        os.ftruncate(self._flag_fd, _FLAG.size)
        self._flag = mmap.mmap(self._flag_fd, _FLAG.size)
        # The children's temp directory (their TMPDIR): each makes its load directory
        # (config.json and symlinks, no plaintext) there, and a killed child cannot
        # remove it; the next spawn and close() do.
        self._tmp = tempfile.mkdtemp(prefix="skiff-llm-worker-")
        self._tmp_finalizer = weakref.finalize(self, shutil.rmtree, self._tmp, True)
        try:
            super().__init__(
                -1, config, deadline_s=step_deadline_s, fault=fault, on_idle_death=on_idle_death
            )
        except BaseException:
            self._release()
            raise

    # ------------------------------------------------------------ lifecycle

    def _child(self) -> tuple[str, list[str], tuple[int, ...], dict[str, str]]:
        """Return the LLM child: the cancel flag and the bundle's memfds, its own TMPDIR."""
        for stale in os.listdir(self._tmp):  # left by a child that was killed
            shutil.rmtree(os.path.join(self._tmp, stale), ignore_errors=True)
        fds = (self._flag_fd, *self._files.values())
        env = {**child_env(), "TMPDIR": self._tmp}
        return "runtime.llm._worker_main", ["--cancel-fd", str(self._flag_fd)], fds, env

    def _load(self) -> None:
        """Have the fresh child load the bundle; raise as `LlmSession` does."""
        load = {"op": "load", "files": self._files, "settings": self._settings}
        reply, _ = self._call(load, None, deadline_s=self.load_deadline_s)
        if not reply.get("ok"):
            error = str(reply.get("error", "the worker could not load the bundle"))
            if reply.get("kind") == "invalid_input":
                raise InvalidInput(error)
            raise ModelLoadError(error)
        try:
            vocab, stops = reply["vocab_size"], reply["stop_token_ids"]
            if type(vocab) is not int or vocab < 1 or not all(type(t) is int for t in stops):
                raise TypeError("bad vocabulary size or stop tokens")
            self.vocab_size, self.stop_token_ids = vocab, tuple(stops)
            self.load_ms = float(reply["load_ms"])
        except (KeyError, TypeError, ValueError) as exc:  # a worker gone wrong: stop it
            self._stop(graceful=False)
            raise ModelLoadError(f"worker sent a malformed load reply ({exc!r})") from None

    def close(self) -> None:
        """Cancel a running generation (so the child can take the exit), then stop."""
        self._cancel(self._seq)
        super().close()
        with self._lock:
            if not self._restarting:  # a restart under way still needs them
                self._release()

    def _release(self) -> None:
        """Free the cancel flag and the children's temp directory."""
        self._tmp_finalizer()
        if self._flag_fd >= 0:
            self._flag.close()
            os.close(self._flag_fd)
            self._flag_fd = -1

    def _restart_body(self) -> None:
        """Restart as WorkerExecutor does; a close that came meanwhile frees the flag now."""
        super()._restart_body()
        with self._lock:
            if self._closed:
                self._release()

    def _cancel(self, seq: int) -> None:
        """Ask the child to stop the generation `seq` before its next step."""
        # Closed (by close(), maybe in another thread): nothing is left to stop.
        with contextlib.suppress(ValueError, TypeError):
            if not self._flag.closed:
                _FLAG.pack_into(self._flag, 0, seq)

    # ------------------------------------------------------------ requests

    def _await_turn(self, deadline: float) -> None:
        """Return once no generation runs and a live child is up; the caller holds the lock."""
        while True:
            while self._active is not None and not self._closed:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise DeadlineExceeded(self._no_turn("a generation ahead of it still runs"))
                self._changed.wait(remaining)
            try:
                self._await_worker(deadline)
            except DeadlineExceeded:
                raise DeadlineExceeded(self._no_turn("the worker was restarting")) from None
            if self._active is None:  # nobody took it while the lock was released
                return

    def _no_turn(self, why: str) -> str:
        return f"no turn on the LLM worker within {self.queue_deadline_s:g} s: {why}"

    def _acquire(self) -> float:
        """Take the lock within the queue deadline; return that deadline (monotonic)."""
        deadline = time.monotonic() + self.queue_deadline_s
        if not self._lock.acquire(timeout=self.queue_deadline_s):
            raise DeadlineExceeded(self._no_turn("requests ahead of it held the worker"))
        return deadline

    def request(self, header: dict, *, steps: int = 1) -> tuple[dict, dict[str, np.ndarray]]:
        """One request, one reply, `steps` step deadlines; raise the child's error as it was."""
        deadline = self._acquire()
        try:
            self._await_turn(deadline)
            reply, arrays = self._call(header, None, deadline_s=self.deadline_s * steps)
            self._trim_log()
        finally:
            self._lock.release()
        if not reply.get("ok"):
            raise _error(reply)
        return reply, arrays

    def stream(
        self,
        header: dict,
        arrays: dict[str, np.ndarray],
        cancelled: Callable[[], bool],
        clock: Callable[[], float],
    ) -> Iterator[Delta]:
        """Run a generation in the child, yielding its deltas as their frames arrive."""
        deadline = self._acquire()
        try:
            self._await_turn(deadline)
            self._seq = seq = (self._seq + 1) & 0xFFFF_FFFF
            start = clock()
            with self._talking():
                assert self._channel is not None
                self._channel.send(header, arrays, seq=seq)
            self._active, channel = seq, self._channel
        finally:
            self._lock.release()
        first: float | None = None
        text, summary = "", None
        done = stopping = False
        try:
            while True:
                if not stopping and cancelled():
                    self._cancel(seq)
                    stopping = True
                with self._lock:
                    if self._channel is not channel:
                        raise ExecutorClosed(f"LLM worker for {self.config.key} was closed")
                    with self._talking():
                        kind, text, summary = self._next_frame(seq)
                if first is None:
                    first = clock()
                if kind == "delta":
                    yield Delta(text)
                elif kind != "tick":
                    done = True  # the child's last frame: "end", or "error" with the reason
                    if summary is None:
                        raise _error({"kind": kind, "error": text})
                    break
        finally:
            self._finish(seq, channel, done)
        assert summary is not None and first is not None
        yield Delta(text, dataclasses.replace(summary, ttft_s=first - start))

    def _next_frame(self, seq: int) -> tuple[str, str, Summary | None]:
        """Read one generation frame: (kind, text, summary).

        Kinds: "tick", "delta", "end" (with the summary), or the child's error kind
        ("invalid_input", "inference") with its message as the text.
        """
        assert self._channel is not None
        frame = self._channel.recv(deadline=time.monotonic() + self.deadline_s)
        if frame.seq != seq:
            raise _wire.ProtocolError(f"frame for request {frame.seq}, not {seq}")
        head = frame.header
        kind, text = head.get("t"), head.get("text", "")
        if not isinstance(text, str):
            raise _wire.ProtocolError("delta text is not a string")
        if kind in ("tick", "delta"):
            return kind, text, None
        if kind == "end":
            return kind, text, _summary(head.get("summary"))
        if kind == "error":
            return str(head.get("kind")), str(head.get("error", "worker error")), None
        raise _wire.ProtocolError(f"unknown frame {kind!r}")

    def _finish(self, seq: int, channel: _wire.Channel | None, done: bool) -> None:
        """End a generation's hold on the worker; one left midway is cancelled and drained.

        Draining keeps the next request from reading this one's frames. It may take the
        frames the consumer never read and a step or two more, all within one step
        deadline; a child that does not end by then is killed (logged, not raised: the
        consumer is already leaving, with an exception of its own or none).
        """
        with self._lock:
            try:
                if channel is None or self._channel is not channel:
                    return  # closed, or crashed and reaped
                if not done:
                    self._cancel(seq)
                    try:
                        with self._talking():
                            self._drain(seq)
                    except WorkerCrashed as exc:
                        logger.warning("LLM worker stopping a cancelled generation: %s", exc)
                if self._channel is channel:
                    self._trim_log()
            finally:
                self._active = None
                self._changed.notify_all()

    def _drain(self, seq: int) -> None:
        """Read a cancelled generation's frames up to its last, within one step deadline."""
        assert self._channel is not None
        limit = time.monotonic() + self.deadline_s
        while True:
            frame = self._channel.recv(deadline=limit)
            if frame.seq != seq:
                raise _wire.ProtocolError(f"frame for request {frame.seq}, not {seq}")
            kind = frame.header.get("t")
            if kind == "end":
                summary = _summary(frame.header.get("summary"))
                reason, count = summary.stop_reason.value, summary.tokens_out
                logger.debug("abandoned generation %d: %s after %d tokens", seq, reason, count)
                return
            if kind == "error":
                return

    @contextlib.contextmanager
    def _talking(self) -> Iterator[None]:
        """Turn a failed exchange with the child into WorkerCrashed, as `_call` does."""
        try:
            yield
        except _wire.FrameTooLarge as exc:
            raise InvalidInput(f"request too large for the worker: {exc}") from None
        except TimeoutError:
            event = self._reap("deadline")
        except _wire.ProtocolError as exc:
            event = self._reap("protocol", str(exc))
        except (EOFError, OSError):
            event = self._reap("died")
        except BaseException:
            self._reap("interrupted")  # its frames may still come: this child must go
            raise
        else:
            return
        raise WorkerCrashed(event) from None


def _check_settings(threads: int, precision: str, memory: str) -> None:
    """Refuse bad MNN settings before spawning, with `LlmSession`'s rules and messages."""
    if not _is_int(threads) or not 1 <= threads <= 256:
        raise InvalidInput(f"threads must be an integer in [1, 256], not {threads!r}")
    if precision not in _PRECISIONS:
        raise InvalidInput(f"precision must be one of {_PRECISIONS}, not {precision!r}")
    if memory not in _MEMORY:
        raise InvalidInput(f"memory must be one of {_MEMORY}, not {memory!r}")


def _error(reply: Mapping[str, Any]) -> Exception:
    """Rebuild the child's error: InvalidInput keeps its type and message."""
    message = str(reply.get("error", "worker error"))
    return (
        InvalidInput(message) if reply.get("kind") == "invalid_input" else InferenceError(message)
    )


def _summary(data: Any) -> Summary:
    """Parse a summary from the child (who may be compromised: plain values only)."""
    try:
        if not isinstance(data, dict):
            raise TypeError("not an object")
        ints = ("tokens_in", "tokens_out")
        floats = ("ttft_s", "prefill_tps", "decode_tps")
        if not all(type(data[k]) is int for k in ints):
            raise TypeError("token counts must be integers")
        if not all(type(data[k]) in (int, float) for k in floats):
            raise TypeError("figures must be numbers")
        out = data["output_ids"]
        if not isinstance(out, list) or not all(type(t) is int for t in out):
            raise TypeError("output_ids must be integers")
        return Summary(
            **{k: data[k] for k in ints},
            **{k: float(data[k]) for k in floats},
            stop_reason=StopReason(data["stop_reason"]),
            output_ids=tuple(out),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise _wire.ProtocolError(f"malformed summary ({exc})") from None


def _token_list(value: Sequence[int], what: str) -> list[int]:
    """Coerce token ids to plain ints for the wire; the child checks them as a session does."""
    if isinstance(value, str | bytes) or not isinstance(value, Sequence | np.ndarray):
        raise InvalidInput(f"{what} must be a sequence of token ids")
    ids = list(value)
    if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) for t in ids):
        raise InvalidInput(f"{what} must be non-negative integers")
    return [int(t) for t in ids]
