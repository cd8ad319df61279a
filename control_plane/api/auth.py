"""API tokens: made once, stored only as SHA-256, checked against the role table.

Operators and scripts authenticate with `authorization: Bearer skf_...`. A token has one
role (see `roles`); it may expire and can be revoked, and both take effect on the next
call (tokens are looked up on every call, never cached).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from contract import errors
from control_plane.api import roles
from control_plane.store.tokens import TokenRecord, TokenStore

TOKEN_PREFIX = "skf_"
TOKEN_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
ADMIN = roles.ADMIN
# What an operator runs when a database has no admin token (see `no_admin_hint`).
BOOTSTRAP_COMMAND = "skiff token create --role admin --offline"


def new_token() -> str:
    """Return a fresh random token (256 bits; prefixed so leaked ones are greppable)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Return the stored form of a token.

    A plain SHA-256 suffices: tokens are 256-bit random, so there is nothing to brute
    force, and a slow KDF would put a cost on every call.
    """
    return hashlib.sha256(token.encode()).hexdigest()


# At most this long: a token that never expires is an explicit choice (--ttl 0).
MAX_TOKEN_TTL_S = 10 * 365 * 86_400
# The last admin token may not be revoked while every other one expires sooner than this.
ADMIN_MARGIN = dt.timedelta(days=1)


def no_admin_hint(db_description: str = "") -> str:
    """Return the one line that says a database has no admin token, and what to do.

    Callers over the network get it without `db_description` (which names a host and a
    database); the server's own startup log gets it with.
    """
    which = f"the database ({db_description})" if db_description else "this server's database"
    return (
        f"{which} has no active admin token, so every call is refused: create one on the "
        f"server host with `{BOOTSTRAP_COMMAND}` (same --home/--db as the server)"
    )


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Authenticator:
    """Checks bearer tokens against the store and the role table."""

    def __init__(self, store: TokenStore, *, clock: Callable[[], dt.datetime] = _now) -> None:
        self._store, self._clock = store, clock

    def identify(self, authorization: str | None) -> TokenRecord:
        """Return the active token an `authorization: Bearer ...` value names.

        Raises Unauthenticated for a missing, malformed, unknown, expired or revoked
        token; the message never echoes the token.
        """
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthenticated("missing bearer token")
        digest = hash_token(token.strip())
        record = self._store.find_token(digest)
        # The lookup is by hash, so its timing says nothing about the token; the final
        # comparison is constant time anyway.
        if record is None or not hmac.compare_digest(record.token_sha256, digest):
            if not self._store.has_admin_token(now=self._clock()):
                raise errors.Unauthenticated(no_admin_hint())
            raise errors.Unauthenticated("invalid token")
        return self._active(record)

    def recheck(self, record: TokenRecord) -> None:
        """Refuse a long call whose token was revoked or expired since it started."""
        self._active(self._store.find_token(record.token_sha256) or record)

    def _active(self, record: TokenRecord) -> TokenRecord:
        state = record.state(self._clock())
        if state != "active":
            raise errors.Unauthenticated(f"token {record.id} ({record.name}) is {state}")
        return record

    def authorize(self, authorization: str | None, rpc: str) -> TokenRecord:
        """Return the caller's token if its role may call `rpc` (a full method name)."""
        needed = roles.RPC_ROLES.get(rpc)
        record = self.identify(authorization)
        if needed is None or not roles.grants(record.role, needed):
            method = rpc.rsplit("/", 1)[-1]
            raise errors.PermissionDenied(
                f"token {record.id} ({record.name}) is {record.role}; {method} needs {needed}"
            )
        return record


@dataclass(frozen=True)
class MadeToken:
    """A new token: the secret (shown once) and its record."""

    secret: str
    record: TokenRecord


class ApiTokens:
    """Creates, lists and revokes API tokens."""

    def __init__(self, store: TokenStore, *, clock: Callable[[], dt.datetime] = _now) -> None:
        self._store, self._clock = store, clock

    def create(self, *, role: str, name: str, ttl_s: int, actor: str) -> MadeToken:
        """Make a token of `role`, valid for `ttl_s` seconds (0 = no end)."""
        if role not in roles.ROLES:
            raise errors.InvalidArgument(
                f"unknown role {role!r:.40}: choose from {', '.join(roles.ROLES)}"
            )
        if name and not TOKEN_NAME.fullmatch(name):
            raise errors.InvalidArgument(
                f"invalid token name {name!r:.80}: use 1-64 of letters, digits, '.', '_', '-'"
            )
        if not 0 <= ttl_s <= MAX_TOKEN_TTL_S:
            raise errors.InvalidArgument(
                f"ttl must be between 0 (never expires) and {MAX_TOKEN_TTL_S}s (10 years)"
            )
        secret = new_token()
        now = self._clock()
        record = self._store.add_token(
            name=name or f"{role}-{secrets.token_hex(3)}",
            role=role,
            token_sha256=hash_token(secret),
            created_by=actor,
            expires_at=now + dt.timedelta(seconds=ttl_s) if ttl_s else None,
        )
        return MadeToken(secret, record)

    def list(self, *, include_inactive: bool = False) -> list[TokenRecord]:
        """Return the active tokens (every token with `include_inactive`)."""
        return self._store.list_tokens(include_inactive=include_inactive, now=self._clock())

    def revoke(self, token_id: str) -> TokenRecord:
        """Revoke a token at once."""
        return self._store.revoke_token(token_id, now=self._clock(), margin=ADMIN_MARGIN)
