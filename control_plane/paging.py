"""Keyset pagination for list calls: page sizes, opaque page tokens, a byte budget.

A page token is the URL-safe base64 of a small JSON object naming what it pages through
(its scope: "models", or one model's versions) and the last key the previous page
returned; the store resumes after that key with `WHERE key > last ORDER BY key LIMIT n`,
so a page costs the same however deep it is, and rows added meanwhile are not skipped.
Tokens are opaque to callers but not secret: they are validated like any other input.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from contract import errors

T = TypeVar("T")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000
# A page stops early once its items add up to this: half the 8 MiB message limit, so a
# page of versions with long notes and large signatures always fits in one response.
MAX_PAGE_BYTES = 4 << 20
MAX_TOKEN_CHARS = 512


@dataclass(frozen=True)
class PageRequest:
    """One page to read: at most `size` items after `after` (None: from the start)."""

    scope: str
    size: int
    after: Any


def page_request(
    page_size: int, page_token: str, *, scope: str, parse_key: Callable[[object], T]
) -> PageRequest:
    """Validate a request's page size and token; `parse_key` checks the token's key.

    `parse_key` raises InvalidArgument (or ValueError/TypeError) for a key that could
    not have come from this scope.
    """
    if page_size < 0:
        raise errors.InvalidArgument(f"page_size {page_size} is negative")
    size = min(page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
    if not page_token:
        return PageRequest(scope, size, None)
    return PageRequest(scope, size, _decode(page_token, scope, parse_key))


def next_page(
    items: Sequence[T],
    page: PageRequest,
    *,
    key: Callable[[T], object],
    byte_size: Callable[[T], int] | None = None,
) -> tuple[list[T], str]:
    """Cut `items` (read with LIMIT page.size + 1) to one page; returns it and the next token.

    With `byte_size`, the page also stops before the item that would take it past
    MAX_PAGE_BYTES (it always holds at least one item). The token is empty on the last page.
    """
    kept = list(items[: page.size])
    if byte_size is not None:
        total = 0
        for i, item in enumerate(kept):
            total += byte_size(item)
            if total > MAX_PAGE_BYTES and i > 0:
                kept = kept[:i]
                break
    if len(kept) == len(items) or not kept:
        return kept, ""
    return kept, _encode(page.scope, key(kept[-1]))


def _encode(scope: str, after: object) -> str:
    raw = json.dumps({"s": scope, "a": after}, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode(token: str, scope: str, parse_key: Callable[[object], T]) -> T:
    invalid = errors.InvalidArgument("invalid page_token: pass next_page_token back unchanged")
    if len(token) > MAX_TOKEN_CHARS:
        raise invalid
    try:
        raw = base64.b64decode(token + "=" * (-len(token) % 4), altchars=b"-_", validate=True)
        body = json.loads(raw)
    except (binascii.Error, ValueError):
        raise invalid from None
    if not isinstance(body, dict) or set(body) != {"s", "a"} or body["s"] != scope:
        raise invalid
    try:
        return parse_key(body["a"])
    except (errors.InvalidArgument, ValueError, TypeError):
        raise invalid from None
