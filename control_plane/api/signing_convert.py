"""Signing-key records to their messages (GetSigningKeys, Enroll and Sync answers)."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf.timestamp_pb2 import Timestamp

from control_plane.store.signing_key_records import SigningKeyRecord
from protos import common_pb2


def _timestamp(value) -> Timestamp | None:
    if value is None:
        return None
    ts = Timestamp()
    ts.FromDatetime(value)
    return ts


def signing_key_pb(record: SigningKeyRecord, *, active: bool) -> common_pb2.SigningKey:
    """Convert one key of the chain."""
    return common_pb2.SigningKey(
        key_id=record.key_id,
        public_key_pem=record.public_key_pem,
        created_at=_timestamp(record.created_at),
        not_after=_timestamp(record.not_after),
        endorsement=record.endorsement,
        endorsement_signature=record.endorsement_signature,
        endorsed_by=record.endorsed_by,
        active=active,
    )


def chain_pb(chain: Sequence[SigningKeyRecord]) -> list[common_pb2.SigningKey]:
    """Convert the whole chain, oldest first; the last key is the active one."""
    return [signing_key_pb(r, active=i == len(chain) - 1) for i, r in enumerate(chain)]
