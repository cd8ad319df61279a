"""The language models this device serves: one `runtime.llm.LlmWorker` per model.

A generation holds its model's worker from the first token to the last; a newly
activated version is swapped in between generations (the old worker closes once its
last generation ends), so no request fails because of an install. Each model runs one
generation at a time; up to `QUEUE` more wait their turn, and any beyond are refused at
once (`Busy`, RESOURCE_EXHAUSTED) rather than queued for minutes. A worker that crashes
`ROLLBACK_CRASHES` times in a row calls `on_failure(model, uid, reason)` once, as the
tensor models' slots do (device_agent.serving).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from device_agent.report_outbox import Collector
from device_agent.serving import ROLLBACK_CRASHES, NotServing

log = logging.getLogger("skiff.agent")

# Generations waiting for a model beyond the one running.
QUEUE = 2
# What a request without max_new_tokens gets.
DEFAULT_MAX_NEW_TOKENS = 256


class Busy(Exception):
    """More generations are waiting for the model than its queue holds."""


class NotAnLlm(Exception):
    """The model is installed but is not a language model (or the reverse)."""


@dataclass
class GenerateRequest:
    """One generation, as the local API checked its shape (the worker checks the rest)."""

    prompt: str = ""
    messages: Sequence[Mapping[str, str]] = ()
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: Sequence[str] = ()


@dataclass
class _Loaded:
    """A worker and the install pointer slot it came from; closed when the last user leaves."""

    worker: object  # runtime.llm.LlmWorker
    info: dict
    name: str = ""
    users: int = 0
    retired: bool = False

    def release(self) -> bool:
        """Count one user out; return whether the worker is now to be closed (its last)."""
        self.users -= 1
        return self.retired and self.users == 0


@dataclass
class _Model:
    loaded: _Loaded
    turn: threading.Semaphore = field(default_factory=lambda: threading.Semaphore(1))
    waiting: int = 0
    crashes_in_row: int = 0
    failing: bool = False


class LlmServing:
    """Serve installed language models; thread-safe."""

    def __init__(
        self,
        collector: Collector,
        on_failure: Callable[[str, str, str], None] | None = None,
    ) -> None:
        self._collector = collector
        self._on_failure = on_failure
        self._lock = threading.Lock()
        self._models: dict[str, _Model] = {}

    # -- what serves ------------------------------------------------------------------------

    def put(self, name: str, info: dict, worker) -> None:
        """Serve `worker` (now owned here) for `name`, from the next generation on."""
        loaded = _Loaded(worker, info, name)
        with self._lock:
            model = self._models.get(name)
            if model is None:
                self._models[name] = _Model(loaded)
                old = None
            else:
                old, model.loaded = model.loaded, loaded
                model.crashes_in_row, model.failing = 0, False
            if old is not None:
                old.retired = True
                idle = old.users == 0
        if old is not None and idle:
            old.worker.close()
        log.info("%s v%d serving (language model)", name, info["version"])

    def drop(self, name: str) -> None:
        """Stop serving `name` (a generation in flight finishes first)."""
        with self._lock:
            model = self._models.pop(name, None)
            if model is None:
                return
            model.loaded.retired = True
            idle = model.loaded.users == 0
        if idle:
            model.loaded.worker.close()

    def close(self) -> None:
        """Stop serving everything."""
        for name in list(self._models):
            self.drop(name)

    def serving(self, name: str) -> dict | None:
        """Return the pointer slot of the version serving `name` now (None if none)."""
        with self._lock:
            model = self._models.get(name)
            return model.loaded.info if model is not None else None

    def names(self) -> list[str]:
        """Return the language models being served."""
        with self._lock:
            return sorted(self._models)

    # -- requests ----------------------------------------------------------------------------

    def generate(
        self, name: str, request: GenerateRequest, cancelled: Callable[[], bool]
    ) -> Iterator[tuple[str, object, dict]]:
        """Yield (text, summary or None, pointer slot) as the model generates.

        Raises NotServing, Busy, or the runtime's InvalidInput (bad prompt or sampling),
        WorkerCrashed, DeadlineExceeded. The generator holds a turn on the model until it
        is exhausted or closed.
        """
        from runtime.llm import Sampling

        model = self._enter(name)
        try:
            loaded = self._start(name, model, cancelled)
            if loaded is None:
                return
            try:
                worker = loaded.worker
                sampling = Sampling(
                    temperature=request.temperature,
                    top_k=request.top_k,
                    top_p=request.top_p,
                    seed=request.seed,
                )
                text = request.prompt
                if request.messages:
                    text = worker.apply_chat_template(list(request.messages))
                ids = worker.encode(text)
                stream = worker.generate(
                    ids,
                    max_new_tokens=request.max_new_tokens,
                    sampling=sampling,
                    stop_strings=tuple(request.stop),
                    cancelled=cancelled,
                )
                yield from self._counted(name, model, loaded, stream)
            finally:
                with self._lock:
                    last = loaded.release()
                if last:  # swapped out or dropped while this generation ran
                    loaded.worker.close()
        finally:
            model.turn.release()

    def _enter(self, name: str) -> _Model:
        """Take a place in the model's queue, or refuse (NotServing, Busy)."""
        with self._lock:
            model = self._models.get(name)
            if model is None:
                raise NotServing(f"model {name!r:.64} is not installed on this device")
            if model.waiting >= QUEUE:
                raise Busy(
                    f"{name}: {model.waiting} generations are already waiting for the one "
                    f"running (a queue of {QUEUE}): try again later"
                )
            model.waiting += 1
        return model

    def _start(self, name: str, model: _Model, cancelled: Callable[[], bool]) -> _Loaded | None:
        """Wait for the model's turn (None: the caller gave up meanwhile)."""
        try:
            while not model.turn.acquire(timeout=0.05):
                if cancelled():
                    return None
        finally:
            with self._lock:
                model.waiting -= 1
        with self._lock:
            if self._models.get(name) is not model:
                model.turn.release()
                raise NotServing(f"model {name!r:.64} was removed")
            loaded = model.loaded
            loaded.users += 1
        return loaded

    def _counted(
        self, name: str, model: _Model, loaded: _Loaded, stream
    ) -> Iterator[tuple[str, object, dict]]:
        from runtime import WorkerCrashed

        summary = None
        try:
            for delta in stream:
                summary = delta.summary or summary
                yield delta.text, delta.summary, loaded.info
        except WorkerCrashed as exc:
            self._count(loaded, None, ok=False)
            self._crashed(name, model, loaded, exc)
            raise
        except GeneratorExit:  # the caller went away (its stream was closed)
            self._count(loaded, summary, ok=True, gone=True)
            raise
        except Exception:
            self._count(loaded, summary, ok=False)
            raise
        with self._lock:
            model.crashes_in_row = 0
        self._count(loaded, summary, ok=True)

    def _count(self, loaded: _Loaded, summary, *, ok: bool, gone: bool = False) -> None:
        """Count one generation of its version: tokens, time to first token, decode speed.

        A generation's latency sample is its decode time per token after the first (see
        device.proto ModelStats); one the caller left before it ended is a cancellation.
        """
        from runtime.llm import StopReason

        figures: dict = {}
        if summary is not None:
            figures = {
                "tokens_in": summary.tokens_in,
                "tokens_out": summary.tokens_out,
                "ttft_ns": _ns(summary.ttft_s) if summary.tokens_out else None,
                "token_ns": _ns(1 / summary.decode_tps) if summary.decode_tps > 0 else None,
            }
        cancelled = gone and (summary is None or summary.stop_reason is StopReason.CANCELLED)
        cancelled = cancelled or (
            summary is not None and summary.stop_reason is StopReason.CANCELLED
        )
        self._collector.generation(_key(loaded), ok=ok, cancelled=cancelled, **figures)

    def _crashed(self, name: str, model: _Model, loaded: _Loaded, exc) -> None:
        info = loaded.info
        self._collector.events(_key(loaded), [exc.event], [])
        with self._lock:
            model.crashes_in_row += 1
            fail = model.crashes_in_row >= ROLLBACK_CRASHES and not model.failing
            model.failing = model.failing or fail
        log.warning("%s v%d worker crashed: %s", name, info["version"], exc)
        if fail and self._on_failure is not None:
            self._on_failure(name, info["uid"], f"crashed {ROLLBACK_CRASHES} times: {exc}")

    def status(self) -> dict[str, dict]:
        """Return what serves per language model (for the agent's status)."""
        with self._lock:
            return {name: dict(m.loaded.info) for name, m in self._models.items()}


def _key(loaded: _Loaded) -> tuple[str, int, str, str]:
    """Return what a generation is counted under: model, version, variant, config."""
    info = loaded.info
    return (loaded.name, info["version"], info["variant"], info.get("config", ""))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
