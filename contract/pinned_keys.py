"""The signing keys a verifier pins, and how it learns the control plane's next key.

The control plane's signing keys form a chain: each key after the first is endorsed by
the key active before it, with a canonical JSON statement naming the new key (id, public
key, creation time) and the endorser's own end of validity. A verifier (a device, the
CLI) starts from keys pinned out of band (at Enroll, at `skiff init` or `skiff key pin`)
and adds a key only when a key it already pins endorsed it; it drops a key once the end
of validity that key itself signed has passed. So nothing the network sends is trusted
on its own, and an old key stops being accepted after the overlap.

As in TUF's root rotation, a pinned key that has since expired can still vouch for its
successor (a device that slept through a rotation catches up), but never signs anything
the device acts on.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from contract.assignment import (
    AssignmentRejected,
    PublicKey,
    canonical_json,
    key_id_of,
    load_public_key,
    signature_valid,
    verify_signed,
)

ENDORSEMENT_SCHEMA = "skiff.signing-key-endorsement/v1"


def endorsement_body(
    *,
    key_id: str,
    public_key_pem: bytes,
    created_at: dt.datetime,
    endorsed_by: str,
    endorser_not_after: dt.datetime,
) -> bytes:
    """Return the canonical statement a key signs to endorse its successor."""
    return canonical_json(
        {
            "schema": ENDORSEMENT_SCHEMA,
            "key_id": key_id,
            "public_key_pem": public_key_pem.decode("ascii"),
            "created_at": created_at.isoformat(),
            "endorsed_by": endorsed_by,
            "endorser_not_after": endorser_not_after.isoformat(),
        }
    )


@dataclass(frozen=True)
class PinnedKey:
    """A trusted signing key and, once its successor says so, the end of its validity."""

    key_id: str
    public_key_pem: bytes = field(repr=False)
    not_after: dt.datetime | None = None

    @property
    def public_key(self) -> PublicKey:
        """Return the parsed key."""
        return load_public_key(self.public_key_pem)

    def valid_at(self, now: dt.datetime) -> bool:
        """Return whether this key may sign what a verifier acts on at `now`."""
        return self.not_after is None or now < self.not_after

    @classmethod
    def from_pem(cls, pem: bytes) -> PinnedKey:
        """Pin a key given out of band; its id is computed, never taken on trust."""
        return cls(key_id_of(load_public_key(pem)), bytes(pem))


class PinnedKeyRing:
    """An immutable set of pinned keys; `update` returns a new ring."""

    def __init__(self, keys: Iterable[PinnedKey]) -> None:
        self._keys: dict[str, PinnedKey] = {k.key_id: k for k in keys}

    @classmethod
    def from_pems(cls, pems: Iterable[bytes]) -> PinnedKeyRing:
        """Pin keys given out of band (no end of validity known yet)."""
        return cls(PinnedKey.from_pem(pem) for pem in pems)

    @classmethod
    def from_enrollment(cls, response, now: dt.datetime) -> PinnedKeyRing:
        """Pin what an Enroll answer names (trust on enrollment), then apply its chain.

        Falls back to the plain PEM list of a server that sends no chain.
        """
        chain = list(response.signing_keys)
        pems = [k.public_key_pem for k in chain] or list(response.signing_public_keys)
        return cls.from_pems(pems).update(chain, now)

    @property
    def keys(self) -> tuple[PinnedKey, ...]:
        """Return every pinned key, valid or not, by id."""
        return tuple(self._keys[k] for k in sorted(self._keys))

    def valid_keys(self, now: dt.datetime) -> list[PublicKey]:
        """Return the keys that may sign what is acted on at `now`."""
        return [k.public_key for k in self.keys if k.valid_at(now)]

    def verify(self, body: bytes, signature: bytes, now: dt.datetime) -> tuple[str, dict]:
        """Return (key id, parsed document) if a key valid at `now` signed these bytes."""
        for k in self.keys:
            if k.valid_at(now) and signature_valid(k.public_key, signature, body):
                return k.key_id, verify_signed(body, signature, [k.public_key])
        raise AssignmentRejected("signature does not verify under any pinned key")

    def update(self, chain: Iterable, now: dt.datetime) -> PinnedKeyRing:
        """Return the ring after walking `chain` (SigningKey messages) from these pins.

        A key is added only through an endorsement that verifies under a key already
        pinned; every other entry is ignored, so an injected key changes nothing. Keys
        whose signed end of validity has passed are dropped.
        """
        keys = dict(self._keys)
        pending = [k for k in chain if k.endorsed_by]
        progress = True
        while progress:
            progress = False
            for entry in list(pending):
                endorser = keys.get(entry.endorsed_by)
                if endorser is None:
                    continue
                pending.remove(entry)
                statement = _endorsement(entry, endorser)
                if statement is None:
                    continue
                ends = dt.datetime.fromisoformat(statement["endorser_not_after"])
                if endorser.not_after is None or ends < endorser.not_after:
                    keys[endorser.key_id] = replace(endorser, not_after=ends)
                if entry.key_id not in keys:
                    keys[entry.key_id] = PinnedKey(entry.key_id, bytes(entry.public_key_pem))
                    progress = True
        return PinnedKeyRing(k for k in keys.values() if k.valid_at(now))

    def to_json(self) -> list[dict]:
        """Return the JSON form stored by the CLI (public keys only: nothing secret)."""
        return [
            {
                "key_id": k.key_id,
                "public_key_pem": k.public_key_pem.decode("ascii"),
                "not_after": k.not_after.isoformat() if k.not_after else None,
            }
            for k in self.keys
        ]

    @classmethod
    def from_json(cls, body: Iterable[Mapping]) -> PinnedKeyRing:
        """Parse `to_json`'s form; ids are recomputed and must match (ValueError if not)."""
        keys = []
        for entry in body:
            pinned = PinnedKey.from_pem(str(entry["public_key_pem"]).encode("ascii"))
            if pinned.key_id != entry["key_id"]:
                raise ValueError(f"pinned key {entry['key_id']!r} does not match its PEM")
            ends = entry.get("not_after")
            keys.append(
                replace(pinned, not_after=dt.datetime.fromisoformat(ends) if ends else None)
            )
        return cls(keys)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PinnedKeyRing) and self.keys == other.keys

    def __hash__(self) -> int:
        return hash(self.keys)

    def __repr__(self) -> str:
        return f"PinnedKeyRing({', '.join(self._keys)})"


def _endorsement(entry, endorser: PinnedKey) -> dict | None:
    """Return the endorsement statement of `entry` if it verifies and names it exactly."""
    if not signature_valid(endorser.public_key, entry.endorsement_signature, entry.endorsement):
        return None
    try:
        statement = json.loads(entry.endorsement)
        key = load_public_key(entry.public_key_pem)
        if dt.datetime.fromisoformat(statement["endorser_not_after"]).tzinfo is None:
            return None
    except (ValueError, TypeError, KeyError, AssignmentRejected):
        return None
    named = {
        "schema": ENDORSEMENT_SCHEMA,
        "key_id": key_id_of(key),
        "public_key_pem": bytes(entry.public_key_pem).decode("ascii", "replace"),
        "endorsed_by": endorser.key_id,
    }
    if (
        not isinstance(statement, dict)
        or canonical_json(statement) != entry.endorsement
        or any(statement.get(k) != v for k, v in named.items())
        or entry.key_id != named["key_id"]
    ):
        return None
    return statement
