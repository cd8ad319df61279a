"""Dashboard sessions on SQL: the web-session half of SqlStore (a mixin, like sql_tokens)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import delete, select

from control_plane.store import orm
from control_plane.store.sessions import (
    MAX_SESSIONS_PER_TOKEN,
    WebSessionRecord,
    WebSessionStore,
)
from control_plane.store.sql_fleet import aware


def _record(row: orm.WebSessionRow) -> WebSessionRecord:
    return WebSessionRecord(
        session_sha256=row.session_sha256,
        token_sha256=row.token_sha256,
        created_at=aware(row.created_at),
        expires_at=aware(row.expires_at),
    )


class SqlWebSessionStore(WebSessionStore):
    """Dashboard sessions; needs `_scope()` and `_read()` from SqlStore."""

    def add_web_session(
        self, *, session_sha256: str, token_sha256: str, expires_at: dt.datetime
    ) -> WebSessionRecord:
        """Store a new session and drop the expired ones (logins are rare: no timer)."""
        with self._scope() as session:
            now = orm.utcnow()
            session.execute(delete(orm.WebSessionRow).where(orm.WebSessionRow.expires_at <= now))
            row = orm.WebSessionRow(
                session_sha256=session_sha256,
                token_sha256=token_sha256,
                created_at=now,
                expires_at=expires_at,
            )
            session.add(row)
            session.flush()
            surplus = session.scalars(
                select(orm.WebSessionRow.session_sha256)
                .where(orm.WebSessionRow.token_sha256 == token_sha256)
                .order_by(orm.WebSessionRow.created_at.desc(), orm.WebSessionRow.session_sha256)
                .offset(MAX_SESSIONS_PER_TOKEN)
            ).all()
            if surplus:
                session.execute(
                    delete(orm.WebSessionRow).where(orm.WebSessionRow.session_sha256.in_(surplus))
                )
            return _record(row)

    def find_web_session(self, session_sha256: str) -> WebSessionRecord | None:
        """Look a session up by its hash."""
        with self._read() as session:
            row = session.get(orm.WebSessionRow, session_sha256)
            return None if row is None else _record(row)

    def delete_web_session(self, session_sha256: str) -> None:
        """End a session."""
        with self._scope() as session:
            session.execute(
                delete(orm.WebSessionRow).where(orm.WebSessionRow.session_sha256 == session_sha256)
            )
