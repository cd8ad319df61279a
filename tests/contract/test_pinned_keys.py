"""The verifier's side of key rotation: walking an endorsement chain from pinned keys."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from contract.assignment import (
    AssignmentRejected,
    canonical_json,
    key_id_of,
    load_public_key,
    verify_signed,
)
from contract.pinned_keys import PinnedKeyRing, endorsement_body
from protos import common_pb2

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)


class Key:
    """A test signing key: Ed25519 by default, ECDSA P-256 with `ecdsa`."""

    def __init__(self, ecdsa: bool = False) -> None:
        self.private = (
            ec.generate_private_key(ec.SECP256R1()) if ecdsa else Ed25519PrivateKey.generate()
        )
        self.pem = self.private.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
        self.id = key_id_of(self.private.public_key())

    def sign(self, body: bytes) -> bytes:
        if isinstance(self.private, ec.EllipticCurvePrivateKey):
            return self.private.sign(body, ec.ECDSA(hashes.SHA256()))
        return self.private.sign(body)


def endorse(new: Key, by: Key, ends: dt.datetime, **override) -> common_pb2.SigningKey:
    statement = endorsement_body(
        key_id=new.id,
        public_key_pem=new.pem,
        created_at=T0,
        endorsed_by=by.id,
        endorser_not_after=ends,
    )
    entry = common_pb2.SigningKey(
        key_id=new.id,
        public_key_pem=new.pem,
        endorsement=statement,
        endorsement_signature=by.sign(statement),
        endorsed_by=by.id,
    )
    for name, value in override.items():
        setattr(entry, name, value)
    return entry


def root(key: Key) -> common_pb2.SigningKey:
    return common_pb2.SigningKey(key_id=key.id, public_key_pem=key.pem)


def ids(ring: PinnedKeyRing) -> set[str]:
    return {k.key_id for k in ring.keys}


def test_walks_a_chain_through_keys_that_have_since_ended():
    k1, k2, k3 = Key(), Key(ecdsa=True), Key()
    chain = [root(k1), endorse(k2, k1, T0 + DAY), endorse(k3, k2, T0 + 2 * DAY)]
    pins = PinnedKeyRing.from_pems([k1.pem])
    during = pins.update(chain, T0)
    assert ids(during) == {k1.id, k2.id, k3.id}
    ends = {k.key_id: k.not_after for k in during.keys}
    assert ends == {k1.id: T0 + DAY, k2.id: T0 + 2 * DAY, k3.id: None}
    # A device that slept through both overlaps catches up, and keeps only the newest.
    assert ids(pins.update(chain, T0 + 3 * DAY)) == {k3.id}
    # Order of the chain does not matter.
    assert ids(pins.update(list(reversed(chain)), T0)) == ids(during)


def test_valid_keys_sign_only_until_their_end():
    k1, k2 = Key(), Key()
    ring = PinnedKeyRing.from_pems([k1.pem]).update([endorse(k2, k1, T0 + DAY)], T0)
    body = canonical_json({"a": 1})
    assert ring.verify(body, k1.sign(body), T0) == (k1.id, {"a": 1})
    assert ring.verify(body, k2.sign(body), T0 + 2 * DAY) == (k2.id, {"a": 1})
    with pytest.raises(AssignmentRejected):
        ring.verify(body, k1.sign(body), T0 + DAY)


def test_refuses_what_no_pinned_key_endorsed():
    k1, k2, stranger = Key(), Key(), Key()
    statement = endorse(k2, k1, T0 + DAY).endorsement
    other_pem = Key().pem
    bad = [
        endorse(k2, stranger, T0 + DAY),  # endorsed by an unknown key
        endorse(k2, k1, T0 + DAY, endorsed_by=stranger.id),  # names another endorser
        endorse(k2, k1, T0 + DAY, endorsement_signature=stranger.sign(statement)),
        endorse(k2, k1, T0 + DAY, public_key_pem=other_pem),  # key swapped after signing
        endorse(k2, k1, T0 + DAY, key_id=Key().id),  # id does not match the key
        endorse(k2, k1, T0 + DAY, endorsement=statement.replace(b"{", b"{ ", 1)),
    ]
    pins = PinnedKeyRing.from_pems([k1.pem])
    for entry in bad:
        ring = pins.update([entry], T0)
        assert ring == pins, entry
        assert all(k.not_after is None for k in ring.keys)  # nor ended the pinned key


def test_endorsement_must_be_signed_over_canonical_json():
    k1, k2 = Key(), Key()
    loose = b'{"schema": "skiff.signing-key-endorsement/v1", "key_id": "' + k2.id.encode() + b'"}'
    entry = endorse(k2, k1, T0 + DAY, endorsement=loose, endorsement_signature=k1.sign(loose))
    assert PinnedKeyRing.from_pems([k1.pem]).update([entry], T0) == PinnedKeyRing.from_pems(
        [k1.pem]
    )


def test_round_trips_through_json_and_rechecks_ids():
    k1, k2 = Key(), Key(ecdsa=True)
    ring = PinnedKeyRing.from_pems([k1.pem]).update([endorse(k2, k1, T0 + DAY)], T0)
    assert PinnedKeyRing.from_json(ring.to_json()) == ring
    forged = ring.to_json()
    forged[0]["key_id"] = "0" * 16
    with pytest.raises(ValueError, match="does not match"):
        PinnedKeyRing.from_json(forged)


def test_accepts_only_ed25519_and_p256_keys():
    p384 = (
        ec.generate_private_key(ec.SECP384R1())
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    for pem in (p384, b"junk"):
        with pytest.raises(AssignmentRejected):
            load_public_key(pem)
    p256 = Key(ecdsa=True)
    body = canonical_json({"x": [1, 2]})
    assert verify_signed(body, p256.sign(body), [load_public_key(p256.pem)]) == {"x": [1, 2]}
    with pytest.raises(AssignmentRejected):
        verify_signed(body + b" ", p256.sign(body), [load_public_key(p256.pem)])
