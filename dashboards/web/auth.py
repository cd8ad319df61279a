"""Dashboard logins: an API token in a form, then a server-side session behind a cookie.

The login form takes the same API tokens as the CLI (any role: viewers see, operators act).
The cookie holds a fresh 256-bit session secret; the database keeps only its SHA-256,
bound to the token's hash, so every replica recognises it, logout ends it everywhere,
and revoking or expiring the token ends its sessions at the next request (the token is
checked again on every one). Forms carry a CSRF value derived from the session secret
(HMAC), which an attacker's page can neither read nor compute.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import secrets
from dataclasses import dataclass

from contract import errors
from control_plane.api import roles
from control_plane.api.auth import Authenticator, hash_token
from control_plane.store.sessions import WebSessionStore
from control_plane.store.tokens import TokenRecord, TokenStore

COOKIE = "skiff_session"
# Absolute lifetime: a session is not extended by use (log in again each working day).
SESSION_TTL = dt.timedelta(hours=12)
_CSRF_LABEL = b"skiff dashboard csrf v1"


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who a dashboard request comes from: the token, and the session it came through."""

    token: TokenRecord
    session_secret: str = ""  # empty for API calls with a bearer token (no CSRF needed)

    @property
    def csrf(self) -> str:
        """Return the CSRF value this session's forms carry."""
        return csrf_for(self.session_secret)

    def may(self, rpc: str) -> bool:
        """Return whether this caller's role may do what `rpc` (a full method name) does."""
        needed = roles.RPC_ROLES.get(rpc)
        return needed is not None and roles.grants(self.token.role, needed)

    def require(self, rpc: str) -> None:
        """Raise PermissionDenied, worded like the gRPC API's, unless `may(rpc)`."""
        if not self.may(rpc):
            method = rpc.rsplit("/", 1)[-1]
            raise errors.PermissionDenied(
                f"token {self.token.id} ({self.token.name}) is {self.token.role}; "
                f"{method} needs {roles.RPC_ROLES.get(rpc)}"
            )


def csrf_for(session_secret: str) -> str:
    """Return the CSRF value of a session (HMAC of a fixed label under the session secret)."""
    return hmac.new(session_secret.encode(), _CSRF_LABEL, hashlib.sha256).hexdigest()


class Sessions:
    """Creates, resolves and ends dashboard sessions."""

    def __init__(self, store: TokenStore, sessions: WebSessionStore, clock=_now) -> None:
        self._tokens, self._sessions, self._clock = store, sessions, clock
        self._auth = Authenticator(store, clock=clock)

    def login(self, token: str) -> tuple[str, TokenRecord]:
        """Return (cookie secret, token record) for a valid API token; Unauthenticated if not."""
        token = token.strip()
        if not token:
            raise errors.Unauthenticated("enter an API token (skiff token create --role viewer)")
        record = self._auth.identify(f"Bearer {token}")
        secret = secrets.token_urlsafe(32)
        self._sessions.add_web_session(
            session_sha256=_digest(secret),
            token_sha256=hash_token(token),
            expires_at=self._clock() + SESSION_TTL,
        )
        return secret, record

    def resolve(self, secret: str | None) -> Caller:
        """Return the caller behind a session cookie; Unauthenticated when it is not valid."""
        if not secret or len(secret) > 128:
            raise errors.Unauthenticated("log in to see the dashboard")
        found = self._sessions.find_web_session(_digest(secret))
        if found is None or found.expires_at <= self._clock():
            raise errors.Unauthenticated("your session ended: log in again")
        record = self._tokens.find_token(found.token_sha256)
        if record is None or record.state(self._clock()) != "active":
            raise errors.Unauthenticated("the token of this session is no longer valid")
        return Caller(record, secret)

    def bearer(self, authorization: str) -> Caller:
        """Return the caller of an API request with `Authorization: Bearer ...`."""
        return Caller(self._auth.identify(authorization))

    def logout(self, secret: str | None) -> None:
        """End the session behind a cookie (if any)."""
        if secret and len(secret) <= 128:
            self._sessions.delete_web_session(_digest(secret))

    @staticmethod
    def check_csrf(caller: Caller, value: str | None) -> None:
        """Refuse a form whose CSRF value is not this session's (PermissionDenied)."""
        if not caller.session_secret or not hmac.compare_digest(
            (value or "").encode(), caller.csrf.encode()
        ):
            raise errors.PermissionDenied(
                "this form is stale or was not made by this dashboard session: reload the "
                "page and try again"
            )
