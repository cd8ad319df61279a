"""Artifact downloads from a presigned URL (an S3-compatible blob store), resumable.

When the blob store can presign, a Sync answer carries a URL per artifact: the device
fetches the ciphertext straight from the store, and the control plane's Download RPC is
only the fallback. Nothing here is trusted for integrity: every segment is checked
against the digests the manifest signs (control_plane.crypto.segments), and the bytes
are ciphertext. The URL's transport follows the rule of every other connection: HTTPS,
or plain HTTP to a loopback host only.
"""

from __future__ import annotations

import asyncio
import ipaddress
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator

CHUNK = 256 << 10
TIMEOUT_S = 30.0

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


async def fetch_url(url: str, offset: int, size: int) -> AsyncIterator[bytes]:
    """Yield the bytes of [offset, size) from `url`; UrlFetchError if it fails or lies."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-{size - 1}"})
    try:
        response = await asyncio.to_thread(urllib.request.urlopen, request, timeout=TIMEOUT_S)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise UrlFetchError(str(getattr(exc, "reason", exc))) from None
    try:
        if response.status != 206 and not (response.status == 200 and offset == 0):
            raise UrlFetchError(f"HTTP {response.status} for a range request")
        got = offset
        while got < size:
            try:
                data = await asyncio.to_thread(response.read, min(CHUNK, size - got))
            except OSError as exc:
                raise UrlFetchError(f"cut at byte {got}: {exc}") from None
            if not data:
                raise UrlFetchError(f"ended at byte {got} of {size}")
            got += len(data)
            yield data
    finally:
        response.close()
