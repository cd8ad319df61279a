"""API tokens: generated once, stored only as SHA-256, checked in constant time."""

from __future__ import annotations

import hashlib
import hmac
import secrets

from control_plane import errors
from control_plane.store.base import RegistryStore, TokenRecord

TOKEN_PREFIX = "skf_"
ADMIN = "admin"


def new_token() -> str:
    """Return a fresh random token (256 bits; prefixed so leaked ones are greppable)."""
    return TOKEN_PREFIX + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    """Return the stored form of a token.

    A plain SHA-256 suffices: tokens are 256-bit random, so there is nothing to brute
    force, and a slow KDF would put a cost on every call.
    """
    return hashlib.sha256(token.encode()).hexdigest()


class Authenticator:
    """Checks bearer tokens against the store."""

    def __init__(self, store: RegistryStore) -> None:
        self._store = store

    def authenticate(self, authorization: str | None, *, role: str = ADMIN) -> TokenRecord:
        """Return the token's record for an `authorization: Bearer ...` value.

        Raises Unauthenticated for a missing, malformed, unknown or under-privileged token;
        the message never echoes the token.
        """
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthenticated("missing bearer token")
        digest = hash_token(token.strip())
        record = self._store.find_token(digest)
        # The lookup is by hash, so its timing says nothing about the token; the final
        # comparison is constant time anyway.
        if record is None or not hmac.compare_digest(record.token_sha256, digest):
            raise errors.Unauthenticated("invalid token")
        if record.role != role:
            raise errors.PermissionDenied(f"token {record.name!r} lacks the {role} role")
        return record
