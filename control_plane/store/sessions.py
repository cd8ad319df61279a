"""The dashboard-session store interface and its record."""

from __future__ import annotations

import abc
import datetime as dt
from dataclasses import dataclass, field

# Sessions one token may hold at once; a new login ends its oldest beyond this, so logging
# in over and over cannot grow the table without bound.
MAX_SESSIONS_PER_TOKEN = 32


@dataclass(frozen=True)
class WebSessionRecord:
    """A dashboard login as stored: hashes only, never the cookie or the token."""

    session_sha256: str = field(repr=False)
    token_sha256: str = field(repr=False)
    created_at: dt.datetime
    expires_at: dt.datetime


class WebSessionStore(abc.ABC):
    """Persistent dashboard sessions (shared by every replica)."""

    @abc.abstractmethod
    def add_web_session(
        self, *, session_sha256: str, token_sha256: str, expires_at: dt.datetime
    ) -> WebSessionRecord:
        """Store a new session; drops expired ones, and the token's oldest past the cap."""

    @abc.abstractmethod
    def find_web_session(self, session_sha256: str) -> WebSessionRecord | None:
        """Look a session up by the hash of its cookie (expired or not)."""

    @abc.abstractmethod
    def delete_web_session(self, session_sha256: str) -> None:
        """End a session (logout); nothing happens for an unknown one."""
