"""Artifact downloads from a presigned URL (an S3-compatible blob store), resumable.

When the blob store can presign, a Sync answer carries a URL per artifact: the device
fetches the ciphertext straight from the store, and the control plane's Download RPC is
only the fallback. Nothing here is trusted for integrity: every segment is checked
against the digests the manifest signs (contract.segments), and the bytes
are ciphertext. The URL's transport follows the rule of every other connection: HTTPS,
or plain HTTP to a loopback host only.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import re
import time
import urllib.parse
from collections.abc import AsyncIterator

CHUNK = 256 << 10
TIMEOUT_S = 30.0
MIN_RATE = 64 << 10  # bytes per second, over the whole transfer
_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

__all__ = ["UrlFetchError", "fetch_url", "usable_url"]


class UrlFetchError(Exception):
    """The URL did not deliver (expired, refused, cut): fall back to the control plane."""


def usable_url(url: str) -> bool:
    """Return whether the agent may fetch from `url` (HTTPS, or HTTP to loopback)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return False
    if parts.scheme == "https" and parts.hostname:
        return True
    return parts.scheme == "http" and _loopback(parts.hostname or "")


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@functools.cache
def _opener():
    """Return the opener of every fetch, which refuses redirects.

    Built, and urllib.request imported (with http.client and email), at the first fetch:
    the agent daemon holds them for nothing until a Sync answer carries a URL.
    """
    import urllib.request

    class NoRedirect(urllib.request.HTTPRedirectHandler):
        """Refuse redirects: a presigned GET needs none, and one could leave HTTPS or loopback."""

        def redirect_request(self, req, fp, code, msg, headers, newurl):  # noqa: D102
            return None  # urllib then raises HTTPError for the 30x

    return urllib.request.build_opener(NoRedirect)


async def fetch_url(url: str, offset: int, size: int) -> AsyncIterator[bytes]:
    """Yield the bytes of [offset, size) from `url`; UrlFetchError if it fails or lies.

    Gives up (UrlFetchError) when a read stalls TIMEOUT_S, or when the whole transfer
    runs below MIN_RATE: a trickling store must not hold an install for ever. Messages
    never carry the URL (its query is a credential).
    """
    import http.client
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + TIMEOUT_S + (size - offset) / MIN_RATE
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-{size - 1}"})
    try:
        response = await asyncio.to_thread(_opener().open, request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as exc:
        raise UrlFetchError(f"HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
        raise UrlFetchError(_describe(exc)) from None
    try:
        _check_range(response, offset, size)
        got = offset
        while got < size:
            if time.monotonic() > deadline:
                raise UrlFetchError(f"too slow: {got - offset} bytes in the time allowed")
            try:
                data = await asyncio.to_thread(response.read, min(CHUNK, size - got))
            except (OSError, http.client.HTTPException) as exc:
                raise UrlFetchError(f"cut at byte {got}: {_describe(exc)}") from None
            if not data:
                raise UrlFetchError(f"ended at byte {got} of {size}")
            got += len(data)
            yield data
    finally:
        response.close()


def _check_range(response, offset: int, size: int) -> None:
    if response.status == 200 and offset == 0:
        return
    if response.status != 206:
        raise UrlFetchError(f"HTTP {response.status} for a range request")
    found = _RANGE.fullmatch(response.headers.get("Content-Range", "").strip())
    if found is None or int(found[1]) != offset:
        raise UrlFetchError(f"the store answered another range than bytes {offset}-")


def _describe(exc: BaseException) -> str:
    """Say what went wrong without the URL (InvalidURL and some URLErrors quote it)."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return type(exc).__name__
