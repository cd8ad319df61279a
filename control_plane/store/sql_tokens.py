"""API tokens on SQL: the token-store half of SqlStore (a mixin, like sql_fleet)."""

from __future__ import annotations

import datetime as dt
import secrets

from sqlalchemy import or_, select

from contract import errors
from control_plane.store import orm
from control_plane.store.sql_fleet import aware
from control_plane.store.tokens import TokenRecord, TokenStore

TOKEN_ID_PREFIX = "tok_"
ADMIN_ROLE = "admin"


def _record(row: orm.TokenRow) -> TokenRecord:
    return TokenRecord(
        id=row.token_id,
        name=row.name,
        role=row.role,
        token_sha256=row.token_sha256,
        created_at=aware(row.created_at),
        created_by=row.created_by,
        expires_at=aware(row.expires_at),
        revoked_at=aware(row.revoked_at),
    )


def _active(now: dt.datetime):
    return (orm.TokenRow.revoked_at.is_(None)) & or_(
        orm.TokenRow.expires_at.is_(None), orm.TokenRow.expires_at > now
    )


def _lasting(admins: list[orm.TokenRow], row: orm.TokenRow, until: dt.datetime) -> bool:
    """Return whether an admin other than `row` stays valid past `until`."""
    return any(
        other.id != row.id and (other.expires_at is None or aware(other.expires_at) > until)
        for other in admins
    )


class SqlTokenStore(TokenStore):
    """API tokens; needs `_scope()` and `_read()` from SqlStore."""

    def add_token(
        self,
        *,
        name: str,
        role: str,
        token_sha256: str,
        created_by: str,
        expires_at: dt.datetime | None = None,
    ) -> TokenRecord:
        """Store a token hash under a fresh id."""
        with self._scope() as session:
            if session.scalar(select(orm.TokenRow.id).where(orm.TokenRow.name == name)):
                raise errors.AlreadyExists(
                    f"a token named {name!r} exists (names stay taken after revocation)"
                )
            row = orm.TokenRow(
                token_id=TOKEN_ID_PREFIX + secrets.token_hex(6),
                name=name,
                role=role,
                token_sha256=token_sha256,
                created_by=created_by,
                expires_at=expires_at,
            )
            session.add(row)
            session.flush()
            return _record(row)

    def find_token(self, token_sha256: str) -> TokenRecord | None:
        """Look a token up by its hash."""
        with self._read() as session:
            row = session.scalar(
                select(orm.TokenRow).where(orm.TokenRow.token_sha256 == token_sha256)
            )
            return None if row is None else _record(row)

    def list_tokens(self, *, include_inactive: bool, now: dt.datetime) -> list[TokenRecord]:
        """Return tokens, oldest first."""
        query = select(orm.TokenRow).order_by(orm.TokenRow.id)
        if not include_inactive:
            query = query.where(_active(now))
        with self._read() as session:
            return [_record(row) for row in session.scalars(query)]

    def revoke_token(
        self, token_id: str, *, now: dt.datetime, margin: dt.timedelta = dt.timedelta(0)
    ) -> TokenRecord:
        """Revoke a token, unless it is the last admin token."""
        with self._scope() as session:
            # Every admin row first, in id order, then the target: two revocations
            # racing for the last two admin tokens queue on the same first lock
            # (PostgreSQL) instead of deadlocking, and cannot both succeed.
            admins = session.scalars(
                select(orm.TokenRow)
                .where(_active(now), orm.TokenRow.role == ADMIN_ROLE)
                .order_by(orm.TokenRow.id)
                .with_for_update()
            ).all()
            row = session.scalar(
                select(orm.TokenRow).where(orm.TokenRow.token_id == token_id).with_for_update()
            )
            if row is None:
                raise errors.NotFound(f"no API token {token_id!r}")
            if row.revoked_at is None:
                if row.role == ADMIN_ROLE and not _lasting(admins, row, now + margin):
                    raise errors.FailedPrecondition(
                        f"{token_id} is the last admin token (the others, if any, expire "
                        "within a day): create another admin token first"
                    )
                row.revoked_at = now
            return _record(row)

    def has_admin_token(self, *, now: dt.datetime) -> bool:
        """Return whether an active admin token exists."""
        with self._read() as session:
            query = select(orm.TokenRow.id).where(_active(now), orm.TokenRow.role == ADMIN_ROLE)
            return session.scalar(query.limit(1)) is not None
