"""The agent's local API: `AgentService` on a Unix socket in the state directory.

Apps on the device call it; nothing here crosses the network. The socket is created
mode 0660 inside the agent's 0700 state directory: who may call is who may reach the
socket (the agent's user, or its group once an operator opens the directory to it).
Every request is checked before it reaches the runtime: a malformed tensor is an
INVALID_ARGUMENT naming the problem, never a crash of the agent. What apps ask of a
model's pipeline is bounded (`device_agent.local_quotas`): a push over its rate, or a
subscriber over the count, is RESOURCE_EXHAUSTED naming the limit, a push's with when to
retry (also as gRPC's `grpc-retry-pushback-ms` trailer), and nothing of it is done.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from contract.limits import MODEL_NAME
from contract.local_api import (
    MAX_MESSAGE_BYTES,
    MAX_TENSORS,
    BadTensor,
    SocketPathTooLong,
    to_array,
    to_tensor,
)
from contract.local_api import socket_path as local_socket_path
from device_agent.llm_serving import (
    DEFAULT_MAX_NEW_TOKENS,
    Busy,
    GenerateRequest,
    LlmServing,
)
from device_agent.local_quotas import Overloaded, pushback_ms
from device_agent.pipelines import (
    Closed,
    Columns,
    EventsRejected,
    NoPipeline,
    Pipelines,
    Result,
)
from device_agent.report_outbox import Collector
from device_agent.serving import NotServing, Serving
from device_agent.state import AgentError, one_line
from protos import agent_pb2, agent_pb2_grpc

log = logging.getLogger("skiff.agent")

PUSH_THREADS = 2
# What one SubscribeBatches message holds at most: results, and bytes (`Result.nbytes`:
# outputs with their names, at least their size as messages; unless one result alone is
# more), well under MAX_MESSAGE_BYTES.
BATCH_RESULTS = 1024
BATCH_BYTES = 4 << 20
# What one Generate may ask: a prompt (or chat) of this many characters, this many tokens.
MAX_PROMPT_CHARS = 256 << 10
MAX_MESSAGES = 256
MAX_NEW_TOKENS = 8192
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
]


def socket_path(state_dir: Path) -> Path:
    """Return the local API socket of a state directory (its length checked)."""
    try:
        return local_socket_path(state_dir)
    except SocketPathTooLong as exc:
        raise AgentError(str(exc)) from None


class AgentServicer(agent_pb2_grpc.AgentServiceServicer):
    """Infer, Status, PushEvents and Subscribe for apps on the device."""

    def __init__(
        self,
        serving: Serving,
        status: Callable[[], Awaitable[agent_pb2.StatusResponse]],
        pipelines: Pipelines | None = None,
        *,
        llm_serving: LlmServing | None = None,
    ) -> None:
        self._serving, self._status = serving, status
        self._pipelines = pipelines or Pipelines(serving, Collector())
        self._llm = llm_serving or LlmServing(Collector())

        # Pushes run their model once per firing: they get threads of their own, so a
        # burst of them never holds up Infer (asyncio's default pool).
        self._push_pool = ThreadPoolExecutor(PUSH_THREADS, thread_name_prefix="skiff-push")

    def close(self) -> None:
        """Let go of the push threads (after the server stopped: no push is left to run)."""
        self._push_pool.shutdown(wait=False, cancel_futures=True)

    async def Infer(self, request, context):  # noqa: D102, N802
        from runtime import (
            DeadlineExceeded,
            InvalidInput,
            ModelFailed,
            RuntimeFailure,
            WorkerCrashed,
        )

        await _check_model(request.model, context)
        if self._llm.serving(request.model) is not None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{request.model} is a language model: call Generate, not Infer",
            )
        if len(request.inputs) > MAX_TENSORS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"at most {MAX_TENSORS} inputs")
        inputs = {}
        try:
            for t in request.inputs:
                if t.name in inputs:
                    raise BadTensor(f"input {t.name!r:.60} is given twice")
                inputs[t.name] = to_array(t)
        except BadTensor as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        try:
            info, config, outputs, latency_ns = await self._serving.infer_async(
                request.model, inputs
            )
        except NotServing as exc:
            code = grpc.StatusCode.UNAVAILABLE if exc.loading else grpc.StatusCode.NOT_FOUND
            await context.abort(code, str(exc))
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, one_line(exc, 500))
        except DeadlineExceeded as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, one_line(exc, 500))
        except (WorkerCrashed, ModelFailed) as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, one_line(exc, 500))
        except RuntimeFailure as exc:
            await context.abort(grpc.StatusCode.INTERNAL, one_line(exc, 500))
        except Exception as exc:  # noqa: BLE001 - never UNKNOWN, never the agent down
            log.error("Infer %s failed: %s: %s", request.model[:64], type(exc).__name__, exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        return agent_pb2.InferResponse(
            model=request.model,
            version=info["version"],
            variant=info["variant"],
            config=config,
            outputs=[to_tensor(k, v) for k, v in outputs.items()],
            latency_us=latency_ns / 1000,
        )

    async def Status(self, request, context):  # noqa: D102, N802
        return await self._status()

    async def PushEvents(self, request, context):  # noqa: D102, N802
        await _check_model(request.model, context)
        events = request.events
        if request.HasField("columns"):
            if events:
                await context.abort(_INVALID, "give events or columns, not both")
            events = Columns(request.columns)
        try:  # on the loop, before the push queues: a flood is turned away at the door
            self._pipelines.admit(request.model, len(events))
        except NoPipeline as exc:
            await context.abort(_no_pipeline_code(exc), str(exc))
        except EventsRejected as exc:
            await context.abort(_INVALID, one_line(exc, 500))
        except Overloaded as exc:
            await _abort_overloaded(context, exc)
        gone = threading.Event()
        context.add_done_callback(lambda _: gone.set())
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else float("inf")
        loop = asyncio.get_running_loop()
        try:
            done = await loop.run_in_executor(
                self._push_pool,
                functools.partial(
                    self._pipelines.push,
                    request.model,
                    list(request.key_fields),
                    list(request.value_fields),
                    events,
                    lambda: gone.is_set() or time.monotonic() > deadline,
                ),
            )
        except NoPipeline as exc:
            await context.abort(_no_pipeline_code(exc), str(exc))
        except EventsRejected as exc:
            await context.abort(_REJECTED.get(exc.reason, _INVALID), one_line(exc, 500))
        except Exception as exc:  # noqa: BLE001 - never UNKNOWN, never the agent down
            log.error("PushEvents %s failed: %s: %s", request.model[:64], type(exc).__name__, exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        return agent_pb2.PushEventsResponse(
            version=done.version, accepted=done.accepted, firings=done.firings, errors=done.errors
        )

    async def Subscribe(self, request, context):  # noqa: D102, N802
        sub = await self._subscribe(request, context)
        try:
            while True:
                result, dropped = await sub.next()
                if result is None:
                    return
                yield result_pb(result, dropped)
        finally:
            self._pipelines.unsubscribe(sub)

    async def SubscribeBatches(self, request, context):  # noqa: D102, N802
        sub = await self._subscribe(request, context)
        try:
            while True:
                batch, ended = await sub.next_batch(BATCH_RESULTS, BATCH_BYTES)
                if batch:
                    yield agent_pb2.PipelineResults(results=[result_pb(r, d) for r, d in batch])
                if ended:
                    return
        finally:
            self._pipelines.unsubscribe(sub)

    async def _subscribe(self, request, context):
        """Open a subscription and send the headers; abort with why it cannot be had.

        The headers go at once: the app knows its subscription is live before it pushes.
        """
        await _check_model(request.model, context)
        try:
            sub = self._pipelines.subscribe(request.model)
        except NoPipeline as exc:
            await context.abort(_no_pipeline_code(exc), str(exc))
        except Closed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except Overloaded as exc:
            await _abort_overloaded(context, exc)
        try:
            await context.send_initial_metadata(())
        except BaseException:
            self._pipelines.unsubscribe(sub)
            raise
        return sub

    async def Generate(self, request, context):  # noqa: D102, N802
        from runtime import DeadlineExceeded, InvalidInput, RuntimeFailure, WorkerCrashed

        name = request.model
        await _check_model(name, context)
        if self._llm.serving(name) is None:
            if self._serving.serving(name) is not None:
                await context.abort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{name} is not a language model: call Infer, not Generate",
                )
            loading = self._serving.is_loading(name)
            code = grpc.StatusCode.UNAVAILABLE if loading else grpc.StatusCode.NOT_FOUND
            what = "is still loading" if loading else "is not installed on this device"
            await context.abort(code, f"model {name!r:.64} {what}")
        try:
            wanted = generate_request(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        stop = threading.Event()  # the caller went away: the generation ends at once
        context.add_done_callback(lambda _: stop.set())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def run() -> None:
            try:
                for item in self._llm.generate(name, wanted, stop.is_set):
                    loop.call_soon_threadsafe(queue.put_nowait, item)
                loop.call_soon_threadsafe(queue.put_nowait, None)
            except BaseException as exc:  # noqa: BLE001 - handed to the handler to answer
                loop.call_soon_threadsafe(queue.put_nowait, exc)

        # A thread of its own, not a pool's: a generation streams for seconds, and a pool
        # full of queued ones would keep a model with an empty queue waiting (and keep
        # the refusal of a full queue from being immediate). LlmServing bounds them: one
        # running and QUEUE waiting per model, the rest refused at once.
        threading.Thread(target=run, name="skiff-generate", daemon=True).start()
        try:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                text, summary, info = item
                if summary is None:
                    if text:
                        yield agent_pb2.GenerateReply(text=text)
                    continue
                yield agent_pb2.GenerateReply(text=text, summary=summary_pb(summary, info))
        except NotServing as exc:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
        except Busy as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except InvalidInput as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, one_line(exc, 500))
        except DeadlineExceeded as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, one_line(exc, 500))
        except WorkerCrashed as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, one_line(exc, 500))
        except RuntimeFailure as exc:
            await context.abort(grpc.StatusCode.INTERNAL, one_line(exc, 500))
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - never UNKNOWN, never the agent down
            log.error("Generate %s failed: %s: %s", name[:64], type(exc).__name__, exc)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        finally:
            stop.set()


def generate_request(request: agent_pb2.GenerateRequest) -> GenerateRequest:
    """Check a Generate request's shape; ValueError names what is wrong.

    The runtime checks the rest (sampling values, the prompt against the context).
    """
    if bool(request.prompt) == bool(request.messages):
        raise ValueError("give a prompt or chat messages (exactly one of them)")
    if len(request.prompt) > MAX_PROMPT_CHARS:
        raise ValueError(
            f"the prompt has {len(request.prompt):,} characters (at most {MAX_PROMPT_CHARS:,})"
        )
    if len(request.messages) > MAX_MESSAGES:
        raise ValueError(f"{len(request.messages)} chat messages (at most {MAX_MESSAGES})")
    if sum(len(m.content) for m in request.messages) > MAX_PROMPT_CHARS:
        raise ValueError(f"the chat messages have more than {MAX_PROMPT_CHARS:,} characters")
    if not 0 <= request.max_new_tokens <= MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens must be 0 (the default) to {MAX_NEW_TOKENS}")
    return GenerateRequest(
        prompt=request.prompt,
        messages=[{"role": m.role, "content": m.content} for m in request.messages],
        max_new_tokens=request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        temperature=request.temperature,
        top_k=request.top_k,
        top_p=request.top_p or 1.0,
        seed=request.seed if request.HasField("seed") else None,
        stop=list(request.stop),
    )


def summary_pb(summary, info: dict) -> agent_pb2.GenerateSummary:
    """Return a generation's summary (runtime.llm.Summary) as its message."""
    return agent_pb2.GenerateSummary(
        tokens_in=summary.tokens_in,
        tokens_out=summary.tokens_out,
        ttft_ms=summary.ttft_s * 1000,
        prefill_tokens_per_s=summary.prefill_tps,
        decode_tokens_per_s=summary.decode_tps,
        stop_reason=summary.stop_reason.value,
        version=info["version"],
        variant=info["variant"],
        config=info.get("config") or "",
    )


_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_REJECTED = {"late": grpc.StatusCode.OUT_OF_RANGE, "cancelled": grpc.StatusCode.CANCELLED}


async def _check_model(name: str, context) -> None:
    """Abort unless `name` can be a model's: the errors that name it must fit a status."""
    if not name:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required")
    if not MODEL_NAME.fullmatch(name):
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model {name!r:.70} is not a model name ({MODEL_NAME.pattern})",
        )


async def _abort_overloaded(context, exc: Overloaded) -> None:
    trailer = ()
    if exc.retry_after_s is not None:
        trailer = (("grpc-retry-pushback-ms", str(pushback_ms(exc.retry_after_s))),)
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailer)


def _no_pipeline_code(exc: NoPipeline) -> grpc.StatusCode:
    if exc.loading:
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.FAILED_PRECONDITION if exc.installed else grpc.StatusCode.NOT_FOUND


def result_pb(r: Result, dropped: int = 0) -> agent_pb2.PipelineResult:
    """Return a pipeline result as its message."""
    return agent_pb2.PipelineResult(
        model=r.model,
        version=r.version,
        trigger=r.trigger,
        key=r.key,
        event_ts_ms=r.ts,
        window_start_ms=r.window_start,
        window_end_ms=r.window_end,
        outputs=[to_tensor(k, v) for k, v in r.outputs.items()],
        error=r.error,
        dropped_before=dropped,
    )


async def start_local_api(state_dir: Path, servicer: AgentServicer) -> tuple[grpc.aio.Server, Path]:
    """Serve `servicer` on the state directory's socket (mode 0660); return server, path."""
    path = socket_path(state_dir)
    path.unlink(missing_ok=True)  # left by a killed agent; the state lock is ours
    server = grpc.aio.server(options=SERVER_OPTIONS)
    agent_pb2_grpc.add_AgentServiceServicer_to_server(servicer, server)
    old = os.umask(0o117)  # the socket is born 0660: never briefly open to others
    try:
        server.add_insecure_port(f"unix:{path}")
        await server.start()
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    log.info("local API on %s", path)
    return server, path
