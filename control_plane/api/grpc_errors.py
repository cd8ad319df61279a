"""The one table mapping domain errors to gRPC status codes."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import grpc

from contract import errors

log = logging.getLogger(__name__)

# Most specific first: InvalidModel is an InvalidArgument.
STATUS_BY_ERROR: tuple[tuple[type[errors.SkiffError], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.TooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Busy, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExists, grpc.StatusCode.ALREADY_EXISTS),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.IntegrityError, grpc.StatusCode.DATA_LOSS),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
)


def status_for(exc: errors.SkiffError) -> grpc.StatusCode:
    """Return the status code for a domain error (INTERNAL when unmapped)."""
    for kind, code in STATUS_BY_ERROR:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def error_for(code: grpc.StatusCode) -> type[errors.SkiffError]:
    """Return the domain error for a status code (the client-side half of the table)."""
    for kind, mapped in STATUS_BY_ERROR:
        if mapped == code:
            return kind
    return errors.Unavailable if code == grpc.StatusCode.DEADLINE_EXCEEDED else errors.SkiffError


def _abort(context: grpc.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, errors.SkiffError):
        context.abort(status_for(exc), str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
    log.exception("unexpected error")
    context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def mapped(method: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate a servicer method so domain errors become status codes (unary responses)."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except Exception as exc:  # noqa: BLE001 - every error leaves as a status
            _abort(context, exc)

    return wrapper


async def _abort_async(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    if isinstance(exc, errors.SkiffError):
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        await context.abort(status_for(exc), message)
    log.error("unexpected error", exc_info=exc)
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")


def mapped_async(method: Callable[..., Any]) -> Callable[..., Any]:
    """Like `mapped`, for `async def` unary handlers of the asyncio server."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort_async(context, exc)

    return wrapper


def mapped_async_stream(method: Callable[..., Any]) -> Callable[..., Any]:
    """Like `mapped`, for async generator handlers (response streams) of the asyncio server."""

    @functools.wraps(method)
    async def wrapper(self, request, context):
        try:
            async for item in method(self, request, context):
                yield item
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            await _abort_async(context, exc)

    return wrapper
