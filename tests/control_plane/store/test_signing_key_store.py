"""The signing-key chain in SQL, on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt

import pytest

from contract import errors
from control_plane.store.signing_key_records import SigningKeyRecord
from control_plane.store.sql_store import SqlStore

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def _key(key_id: str, endorsed_by: str = "") -> SigningKeyRecord:
    return SigningKeyRecord(
        key_id=key_id,
        public_key_pem=f"pem-{key_id}".encode(),
        private_key_ref=f"/keys/{key_id}.pem",
        created_at=T0,
        not_after=None,
        endorsement=b"statement" if endorsed_by else b"",
        endorsement_signature=b"sig" if endorsed_by else b"",
        endorsed_by=endorsed_by,
    )


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


def test_root_is_registered_once(store):
    assert store.signing_keys() == []
    assert store.add_root_signing_key(_key("a")) == [_key("a")]
    # A second replica (or an old home's key file) does not replace the chain.
    assert store.add_root_signing_key(_key("b")) == [_key("a")]


def test_rotation_appends_ends_the_previous_key_and_resigns(store):
    store.add_root_signing_key(_key("a"))
    ends = T0 + dt.timedelta(days=7)
    resigned = store.rotate_signing_key(
        _key("b", endorsed_by="a"), previous="a", previous_not_after=ends, resign=lambda b: (b, "b")
    )
    assert resigned == 0  # no versions yet
    chain = store.signing_keys()
    assert [k.key_id for k in chain] == ["a", "b"]
    assert chain[0].not_after == ends and chain[1].not_after is None
    assert chain[1].endorsed_by == "a" and chain[1].endorsement == b"statement"
    # A rotation that started from a key no longer active changes nothing.
    with pytest.raises(errors.FailedPrecondition, match="changed during rotation"):
        store.rotate_signing_key(
            _key("c", endorsed_by="a"),
            previous="a",
            previous_not_after=ends,
            resign=lambda b: (b, "c"),
        )
    assert [k.key_id for k in store.signing_keys()] == ["a", "b"]
    assert store.signing_keys()[0].not_after == ends
