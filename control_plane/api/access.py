"""The gate every call passes: the role table, enforced before a request is read.

One server interceptor looks each call's method up in `roles.RPC_ROLES`. Calls that
need an API token are authenticated (in a worker thread: it reads the database) before
their first message is even parsed, so an anonymous caller costs one lookup and no log
line. Calls the table does not list are refused. Every handler's request parser is
wrapped too: a malformed message is INVALID_ARGUMENT with one line, not grpc's
"Exception deserializing request!" traceback in the server log.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from contract import errors
from control_plane.api import roles
from control_plane.api.auth import Authenticator
from control_plane.api.grpc_errors import status_for
from control_plane.store.tokens import TokenRecord

_caller: contextvars.ContextVar[TokenRecord | None] = contextvars.ContextVar(
    "skiff_caller", default=None
)
_MALFORMED_MESSAGE = "malformed request: not a valid protobuf message for this method"


def caller() -> TokenRecord:
    """Return the API token of the call being handled (set by `AccessInterceptor`)."""
    record = _caller.get()
    if record is None:  # a handler reached without the interceptor: refuse, never assume
        raise errors.Unauthenticated("call was not authenticated")
    return record


def check_table(server_methods: Iterable[str]) -> None:
    """Refuse to start a server that serves a method the role table does not list."""
    missing = sorted(set(server_methods) - set(roles.RPC_ROLES))
    if missing:
        raise RuntimeError(f"RPCs missing from control_plane/api/roles.py: {missing}")


class _Malformed:
    """Stands in for a request that did not parse; the handler wrapper refuses it."""


def _lenient(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def parse(raw: bytes) -> Any:
        try:
            return deserializer(raw)
        except (DecodeError, ValueError, TypeError):
            return _Malformed()

    return parse


def _checked(requests: Iterator[Any]) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, _Malformed):
            raise errors.InvalidArgument(_MALFORMED_MESSAGE)
        yield request


async def _checked_async(requests):
    async for request in requests:
        if isinstance(request, _Malformed):
            raise errors.InvalidArgument(_MALFORMED_MESSAGE)
        yield request


def _kind(handler: grpc.RpcMethodHandler) -> tuple[str, Callable[..., Any]]:
    if handler.request_streaming and handler.response_streaming:
        return "stream_stream", handler.stream_stream
    if handler.request_streaming:
        return "stream_unary", handler.stream_unary
    if handler.response_streaming:
        return "unary_stream", handler.unary_stream
    return "unary_unary", handler.unary_unary


_FACTORIES = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


def _rebuild(handler: grpc.RpcMethodHandler, behavior, deserializer) -> grpc.RpcMethodHandler:
    kind, _ = _kind(handler)
    return _FACTORIES[kind](
        behavior,
        request_deserializer=deserializer,
        response_serializer=handler.response_serializer,
    )


def _refusal(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str):
    """Return a handler of the same shape that refuses without reading a request."""
    kind, _ = _kind(handler)

    async def refuse(_request, context):
        await context.abort(code, message)

    async def refuse_stream(_request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    behavior = refuse_stream if handler.response_streaming else refuse
    return _FACTORIES[kind](
        behavior,
        request_deserializer=lambda _raw: None,
        response_serializer=handler.response_serializer,
    )


def _guarded(handler: grpc.RpcMethodHandler, record: TokenRecord | None):
    """Wrap `handler`'s behavior: refuse malformed requests, expose the caller."""
    kind, behavior = _kind(handler)
    streaming_in = handler.request_streaming

    if inspect.isasyncgenfunction(behavior):

        async def wrapped(request, context):
            if not streaming_in and isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED_MESSAGE)
            source = _checked_async(request) if streaming_in else request
            _caller.set(record)  # a coroutine's context is its own: no reset needed
            async for item in behavior(source, context):
                yield item

    elif inspect.iscoroutinefunction(behavior):

        async def wrapped(request, context):
            if not streaming_in and isinstance(request, _Malformed):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED_MESSAGE)
            source = _checked_async(request) if streaming_in else request
            _caller.set(record)
            return await behavior(source, context)

    elif handler.response_streaming:
        # A plain generator runs in the server's thread pool, a step at a time; the
        # caller is set around each step, since the steps may run on different threads.
        def wrapped(request, context):
            if not streaming_in and isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED_MESSAGE)
            source = _checked(request) if streaming_in else request
            steps = iter(behavior(source, context))
            while True:
                token = _caller.set(record)
                try:
                    item = next(steps)
                except StopIteration:
                    return
                finally:
                    _caller.reset(token)
                yield item

    else:

        def wrapped(request, context):
            if not streaming_in and isinstance(request, _Malformed):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, _MALFORMED_MESSAGE)
            source = _checked(request) if streaming_in else request
            token = _caller.set(record)
            try:
                return behavior(source, context)
            finally:
                _caller.reset(token)

    return _rebuild(handler, wrapped, _lenient(handler.request_deserializer))


class AccessInterceptor(grpc.aio.ServerInterceptor):
    """Enforces the role table on every call (see the module docstring)."""

    def __init__(self, authenticator: Authenticator) -> None:
        self._auth = authenticator
        # Device and public calls' guarded handlers, by method: they carry no caller, so
        # one per method serves every call (wrapping each call cost a device call ~20 us).
        self._unauthorized: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):  # noqa: D102
        handler = await continuation(handler_call_details)
        if handler is None:
            return None  # unknown method: grpc answers UNIMPLEMENTED
        method = handler_call_details.method
        needed = roles.RPC_ROLES.get(method)
        if needed is None:
            return _refusal(handler, grpc.StatusCode.PERMISSION_DENIED, f"{method} is not served")
        if needed not in roles.ROLES:
            # Device, enrollment and public calls check their own credentials.
            guarded = self._unauthorized.get(method)
            if guarded is None:
                guarded = self._unauthorized[method] = _guarded(handler, None)
            return guarded
        metadata = dict(handler_call_details.invocation_metadata or ())
        try:
            record = await asyncio.to_thread(
                self._auth.authorize, metadata.get("authorization"), method
            )
        except errors.SkiffError as exc:
            return _refusal(handler, status_for(exc), str(exc))
        return _guarded(handler, record)
