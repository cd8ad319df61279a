"""SQL implementation of the signing-key store, mixed into `SqlStore` (one engine, one scope)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract import errors
from control_plane.store import orm
from control_plane.store.signing_key_records import Resigner, SigningKeyRecord, SigningKeyStore
from control_plane.store.sql_fleet import aware


def _record(row: orm.SigningKeyRow) -> SigningKeyRecord:
    return SigningKeyRecord(
        key_id=row.key_id,
        public_key_pem=row.public_key_pem,
        private_key_ref=row.private_key_ref,
        created_at=aware(row.created_at),
        not_after=aware(row.not_after),
        endorsement=row.endorsement,
        endorsement_signature=row.endorsement_signature,
        endorsed_by=row.endorsed_by,
    )


def _row(r: SigningKeyRecord) -> orm.SigningKeyRow:
    return orm.SigningKeyRow(
        key_id=r.key_id,
        public_key_pem=r.public_key_pem,
        private_key_ref=r.private_key_ref,
        created_at=r.created_at,
        not_after=r.not_after,
        endorsement=r.endorsement,
        endorsement_signature=r.endorsement_signature,
        endorsed_by=r.endorsed_by,
    )


_CHAIN = select(orm.SigningKeyRow).order_by(orm.SigningKeyRow.seq)


def _resign(session: Session, key_id: str, resign: Resigner) -> int:
    rows = session.scalars(
        select(orm.VersionRow).where(orm.VersionRow.signing_key_id != key_id).with_for_update()
    ).all()
    for row in rows:
        # The body is unchanged (devices check its digest); only the signature moves.
        row.manifest_signature, row.signing_key_id = resign(row.manifest)
    return len(rows)


class SqlSigningKeyStore(SigningKeyStore):
    """The signing-key chain in SQL; needs `_scope` and `_read` from `SqlStore`."""

    def signing_keys(self) -> list[SigningKeyRecord]:
        """Return the chain, oldest first."""
        with self._read() as session:
            return [_record(r) for r in session.scalars(_CHAIN)]

    def add_root_signing_key(self, root: SigningKeyRecord) -> list[SigningKeyRecord]:
        """Register the first key unless a chain exists; a racing replica's root wins."""
        try:
            with self._scope() as session:
                if session.scalar(select(orm.SigningKeyRow.seq).limit(1)) is None:
                    session.add(_row(root))
        except errors.AlreadyExists:
            pass  # another replica registered the same key first
        return self.signing_keys()

    def rotate_signing_key(
        self,
        new: SigningKeyRecord,
        *,
        previous: str,
        previous_not_after: dt.datetime,
        resign: Resigner,
    ) -> int:
        """Append `new`, end `previous` and re-sign manifests, in one transaction."""
        with self._scope() as session:
            # Row locks serialise rotations on PostgreSQL; SQLite holds the write lock.
            chain = session.scalars(_CHAIN.with_for_update()).all()
            if not chain or chain[-1].key_id != previous:
                raise errors.FailedPrecondition(
                    "the active signing key changed during rotation; retry"
                )
            chain[-1].not_after = previous_not_after
            session.add(_row(new))
            return _resign(session, new.key_id, resign)

    def resign_manifests(self, key_id: str, resign: Resigner) -> int:
        """Re-sign every manifest not signed by `key_id`."""
        with self._scope() as session:
            return _resign(session, key_id, resign)
