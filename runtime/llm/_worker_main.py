"""The LLM worker process: one `LlmSession` for `runtime.llm.worker`, nothing else.

Started as ``python -m runtime.llm._worker_main --sock-fd N --cancel-fd C --parent-pid P``
with the bundle's sealed memfds inherited under the parent's descriptor numbers. It
serves `runtime._wire` frames until the socket closes: ``load`` (the memfd numbers and
MNN settings: the session makes its own directory of ``/proc/self/fd/N`` symlinks, which
only resolve in this process), ``encode``, ``chat``, ``logits``, ``generate`` and
``exit``. Every reply carries its request's sequence number.

A generation answers with one frame per model step: ``delta`` (text), or ``tick`` when
the step produced no text, so the parent's per-step deadline holds; then ``end`` with the
summary, or ``error``. Before every step the session asks whether to stop, and this
process reads the shared cancel flag (the memfd at C, 4 bytes): it holds the sequence
number of the request the parent wants stopped.

Hardened like `runtime._worker_main` (its code, reused): undumpable, SIGKILLed with the
parent, terminal signals ignored, C stdout line-buffered into the parent's log memfd.
``--fault`` (tests only, see `runtime.worker.Fault`) counts model steps.
"""

from __future__ import annotations

import argparse
import mmap
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Callable
from typing import Any

import runtime._wire as _wire
from runtime._worker_main import _harden, _parse_fault, _trigger
from runtime.errors import InferenceError, InvalidInput, RuntimeFailure
from runtime.llm.session import LlmSession, Sampling
from runtime.mnn_host import line_buffer_native_stdout

__all__ = ["main"]

_FLAG = struct.Struct("<I")


def main(argv: list[str] | None = None) -> int:
    """Serve the parent until it closes the socket or says exit; return the exit status."""
    args = _parser().parse_args(argv)
    if not _harden(args.parent_pid):
        return 1
    line_buffer_native_stdout()  # MNN's last words before a crash reach the log
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent alone decides when we stop
    flag = mmap.mmap(args.cancel_fd, _FLAG.size)
    os.close(args.cancel_fd)
    fault = _parse_fault(args.fault) if args.fault else None
    server = _Server(_wire.Channel(socket.socket(fileno=args.sock_fd)), flag, fault)
    try:
        return server.serve()
    finally:
        server.close()


class _Server:
    """The request loop and its session."""

    def __init__(
        self, channel: _wire.Channel, flag: mmap.mmap, fault: tuple[str, int, str] | None
    ) -> None:
        self.channel, self.flag, self.fault = channel, flag, fault
        self.session: LlmSession | None = None
        self.steps = 0  # model steps of this process, for --fault

    def serve(self) -> int:
        handlers: dict[str, Callable[[LlmSession, int, dict, dict], None]] = {
            "encode": self._encode,
            "chat": self._chat,
            "logits": self._logits,
            "generate": self._generate,
        }
        while True:
            try:
                seq, header, arrays = self.channel.recv()
            except (EOFError, ConnectionError, _wire.ProtocolError):
                return 0  # the parent is gone or talking nonsense: nothing left to serve
            op = header.get("op")
            handler = handlers.get(op) if isinstance(op, str) else None
            if op == "exit":
                return 0
            if op == "load":
                self.channel.send(self._load(header), seq=seq)
            elif handler is not None and self.session is not None:
                handler(self.session, seq, header, arrays)
            else:
                self.channel.send(
                    {"ok": False, "kind": "protocol", "error": f"bad op {op!r}"}, seq=seq
                )

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def _load(self, header: dict[str, Any]) -> dict[str, Any]:
        self.close()
        start = time.perf_counter()
        try:
            files = {str(k): int(v) for k, v in header["files"].items()}
            self.session = LlmSession(files, **header["settings"])
        except Exception as exc:  # noqa: BLE001 - every failure goes back as a reply
            return _failure(exc, "load")
        return {
            "ok": True,
            "vocab_size": int(self.session._engine.vocab_size),
            "stop_token_ids": sorted(self.session.stop_token_ids),
            "load_ms": (time.perf_counter() - start) * 1000.0,
            "pid": os.getpid(),
        }

    def _encode(self, session: LlmSession, seq: int, header: dict, arrays: dict) -> None:
        try:
            reply = {"ok": True, "ids": [int(t) for t in session.encode(header.get("text"))]}
        except Exception as exc:  # noqa: BLE001
            reply = _failure(exc)
        self.channel.send(reply, seq=seq)

    def _chat(self, session: LlmSession, seq: int, header: dict, arrays: dict) -> None:
        try:
            reply = {"ok": True, "text": session.apply_chat_template(header.get("messages"))}
        except Exception as exc:  # noqa: BLE001
            reply = _failure(exc)
        self.channel.send(reply, seq=seq)

    def _logits(self, session: LlmSession, seq: int, header: dict, arrays: dict) -> None:
        try:
            rows = session.logits(header.get("prompt"), header.get("continuation"))
        except Exception as exc:  # noqa: BLE001
            self.channel.send(_failure(exc), seq=seq)
            return
        self.channel.send({"ok": True}, {"logits": rows}, seq=seq)

    def _generate(self, session: LlmSession, seq: int, header: dict, arrays: dict) -> None:
        """Stream one generation: a frame per model step, then the summary."""
        sent, steps = [True], [0]

        def stop_now() -> bool:
            # Called before every model step: the previous step's frame goes out here if
            # it produced no text, so the parent hears from us once per step.
            if steps[0] and not sent[0]:
                self.channel.send({"t": "tick"}, seq=seq)
            steps[0] += 1
            sent[0] = False
            self._step()
            return _FLAG.unpack_from(self.flag, 0)[0] == seq

        try:
            ids = arrays["ids"].tolist()
            stream = session.generate(
                ids,
                max_new_tokens=header["max_new_tokens"],
                sampling=Sampling(**header["sampling"]),
                stop_strings=header["stop_strings"],
                cancelled=stop_now,
            )
            for delta in stream:
                if delta.summary is None:
                    self.channel.send({"t": "delta", "text": delta.text}, seq=seq)
                    sent[0] = True
                else:
                    end = {"t": "end", "text": delta.text, "summary": delta.summary.to_dict()}
                    self.channel.send(end, seq=seq)
        except OSError:
            raise  # the parent is gone: nothing to tell it
        except Exception as exc:  # noqa: BLE001 - the stream ends with the error
            self.channel.send({"t": "error", **_failure(exc)}, seq=seq)

    def _step(self) -> None:
        """Count a model step; die the test's way on the chosen one."""
        self.steps += 1
        if self.fault is not None and self.steps == self.fault[1]:
            _trigger(self.fault[0])


def _failure(exc: Exception, default: str = "inference") -> dict[str, Any]:
    """Describe an error for the parent; InvalidInput keeps its message exactly."""
    if isinstance(exc, InvalidInput):
        return {"ok": False, "kind": "invalid_input", "error": str(exc)}
    if isinstance(exc, InferenceError):
        return {"ok": False, "kind": "inference", "error": str(exc)}
    message = str(exc) if isinstance(exc, RuntimeFailure) else f"{type(exc).__name__}: {exc}"
    return {"ok": False, "kind": default, "error": message}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runtime.llm._worker_main")
    parser.add_argument("--sock-fd", type=int, required=True)
    parser.add_argument("--cancel-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--fault", help=argparse.SUPPRESS)
    return parser


if __name__ == "__main__":
    sys.exit(main())
