"""The API-token store interface and its record (operators' tokens, not devices')."""

from __future__ import annotations

import abc
import datetime as dt
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenRecord:
    """An API token as stored: only its SHA-256, never the token itself."""

    id: str
    name: str
    role: str
    token_sha256: str = field(repr=False)
    created_at: dt.datetime
    created_by: str
    expires_at: dt.datetime | None = None
    revoked_at: dt.datetime | None = None

    def state(self, now: dt.datetime) -> str:
        """Return "active", "expired" or "revoked"."""
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= now:
            return "expired"
        return "active"


class TokenStore(abc.ABC):
    """Persistent API tokens."""

    @abc.abstractmethod
    def add_token(
        self,
        *,
        name: str,
        role: str,
        token_sha256: str,
        created_by: str,
        expires_at: dt.datetime | None = None,
    ) -> TokenRecord:
        """Store a token hash under a fresh id; AlreadyExists for a taken name or hash."""

    @abc.abstractmethod
    def find_token(self, token_sha256: str) -> TokenRecord | None:
        """Look a token up by its hash (whatever its state)."""

    @abc.abstractmethod
    def list_tokens(self, *, include_inactive: bool, now: dt.datetime) -> list[TokenRecord]:
        """Return tokens, oldest first; only active ones unless `include_inactive`."""

    @abc.abstractmethod
    def revoke_token(
        self, token_id: str, *, now: dt.datetime, margin: dt.timedelta = dt.timedelta(0)
    ) -> TokenRecord:
        """Revoke a token at once.

        NotFound for an unknown id; FailedPrecondition for the last admin token, that is,
        when no other admin token stays valid for at least `margin` (revoking it would
        lock every operator out).
        """

    @abc.abstractmethod
    def has_admin_token(self, *, now: dt.datetime) -> bool:
        """Return whether any active admin token exists."""
