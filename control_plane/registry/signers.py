"""The active signing key, shared by every replica through the database, and its rotation.

Everything that signs (the registry's manifests, delivery's assignments) signs through
`SigningKeys`, which signs with the newest key of the chain stored in the database, so
replicas agree on the active key within `REFRESH_S`. A rotation makes a new key (a 0600
Ed25519 file under the home's keys/, or an asymmetric KMS key), endorses it with the
current key, ends the current key after an overlap, and re-signs every stored manifest
with the new key in the same transaction, so no version depends on a key after it ends.
An existing home (one signing_ed25519.pem, no chain yet) registers that key as the root.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from contract import errors
from contract.pinned_keys import endorsement_body
from control_plane.crypto.kms_signer import KMS_SCHEME, KmsSigner, parse_kms_url
from control_plane.crypto.signing import ManifestSigner, SignedManifest, Signer
from control_plane.store.signing_key_records import SigningKeyRecord, SigningKeyStore

# How stale a replica's view of the active key may be (one small read per interval).
REFRESH_S = 5.0


class SigningKeys(Signer):
    """Signs with the active key of the shared chain; rotates it."""

    def __init__(
        self,
        store: SigningKeyStore,
        *,
        keys_dir: Path,
        kms_endpoint: str,
        kms_region: str,
        default_overlap_s: int,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store, self._keys_dir = store, Path(keys_dir)
        self._kms_endpoint, self._kms_region = kms_endpoint, kms_region
        self._default_overlap = default_overlap_s
        self._clock, self._monotonic = clock, monotonic
        self._lock = threading.Lock()
        self._chain: tuple[SigningKeyRecord, ...] = ()
        self._fresh_until = float("-inf")
        self._signers: dict[str, Signer] = {}

    def register_root(self, root: Signer, private_key_ref: str) -> None:
        """Make `root` the first key of the chain if there is none yet."""
        record = SigningKeyRecord(
            key_id=root.key_id,
            public_key_pem=root.public_key_pem(),
            private_key_ref=private_key_ref,
            created_at=self._clock().replace(microsecond=0),
            not_after=None,
            endorsement=b"",
            endorsement_signature=b"",
            endorsed_by="",
        )
        with self._lock:
            self._signers.setdefault(root.key_id, root)
            self._chain = tuple(self._store.add_root_signing_key(record))
            self._fresh_until = self._monotonic() + REFRESH_S

    # -- reading the chain ------------------------------------------------------------------

    def chain(self, *, fresh: bool = False) -> tuple[SigningKeyRecord, ...]:
        """Return the chain, oldest first (re-read from the database every REFRESH_S).

        `fresh` re-reads it now: for an operator's question, which must not answer with
        what another replica (or another worker of this one) has already rotated away.
        """
        if fresh or self._monotonic() >= self._fresh_until:
            with self._lock:
                self._refresh()
        return self._chain

    def _refresh(self) -> None:
        chain = tuple(self._store.signing_keys())
        if not chain:
            raise errors.FailedPrecondition("no signing key registered (run `skiff init`)")
        self._chain, self._fresh_until = chain, self._monotonic() + REFRESH_S

    def active_if_ready(self) -> tuple[Signer, tuple[SigningKeyRecord, ...]] | None:
        """Return (active signer, chain) if signing needs no I/O now, else None.

        Ready: the chain needs no re-read and the active key is a local key already
        opened (a KMS key signs over the network). For callers on an event loop.
        """
        if self._monotonic() >= self._fresh_until:
            return None
        chain = self._chain
        signer = self._signers.get(chain[-1].key_id)
        return (signer, chain) if isinstance(signer, ManifestSigner) else None

    def valid_key_ids(self, *, cached_only: bool = False) -> frozenset[str] | None:
        """Return the ids of the keys verifiers may accept now.

        None with `cached_only` when the chain is due for a re-read (for the event loop).
        """
        if cached_only:
            if self._monotonic() >= self._fresh_until:
                return None
            chain = self._chain  # fresh: never a re-read (and its lock) on the loop
        else:
            chain = self.chain()
        now = self._clock()
        return frozenset(k.key_id for k in chain if k.not_after is None or now < k.not_after)

    def valid_public_keys(self) -> list[bytes]:
        """Return the PEMs of the keys verifiers may accept now."""
        now = self._clock()
        return [k.public_key_pem for k in self.chain() if k.not_after is None or now < k.not_after]

    def active(self) -> Signer:
        """Return the signer of the active (newest) key."""
        return self._signer_for(self.chain()[-1])

    def active_and_chain(
        self, *, fresh: bool = False
    ) -> tuple[Signer, tuple[SigningKeyRecord, ...]]:
        """Return the active key's signer and the chain it heads, from one read of it.

        What signs an answer and the chain sent with it must agree: `active()` and
        `chain()` called one after the other may straddle a re-read.
        """
        chain = self.chain(fresh=fresh)
        return self._signer_for(chain[-1]), chain

    def _signer_for(self, record: SigningKeyRecord) -> Signer:
        signer = self._signers.get(record.key_id)
        if signer is None:
            signer = self._open(record.private_key_ref)
            if signer.key_id != record.key_id:
                raise errors.IntegrityError(
                    f"{record.private_key_ref} holds key {signer.key_id}, not {record.key_id}"
                )
            self._signers[record.key_id] = signer
        return signer

    def _open(self, ref: str) -> Signer:
        if ref.startswith(KMS_SCHEME):
            return KmsSigner(
                parse_kms_url(ref), endpoint_url=self._kms_endpoint, region=self._kms_region
            )
        return ManifestSigner.load(ref)

    # -- Signer -----------------------------------------------------------------------------

    @property
    def key_id(self) -> str:
        """Return the active key's id."""
        return self.chain()[-1].key_id

    def public_key_pem(self) -> bytes:
        """Return the active key's public PEM."""
        return self.chain()[-1].public_key_pem

    def sign_bytes(self, body: bytes) -> bytes:
        """Sign with the active key."""
        return self.active().sign_bytes(body)

    def sign(self, manifest: dict[str, Any]) -> SignedManifest:
        """Sign with the active key, naming that same key (one lookup for both)."""
        return self.active().sign(manifest)

    # -- rotation ---------------------------------------------------------------------------

    def rotate(
        self, new_key: str = "", overlap_s: int = 0
    ) -> tuple[SigningKeyRecord, SigningKeyRecord, int]:
        """Make a new active key; returns (previous, active, manifests re-signed).

        `new_key` empty: a new local Ed25519 key; ``aws-kms://KEY``: that KMS key.
        """
        if overlap_s < 0:
            raise errors.InvalidArgument(f"overlap must not be negative, got {overlap_s}")
        overlap = dt.timedelta(seconds=overlap_s or self._default_overlap)
        with self._lock:
            self._refresh()
            current = self._chain[-1]
            previous = self._signer_for(current)
            new, ref, made = self._new_signer(new_key)
            try:
                if any(k.key_id == new.key_id for k in self._chain):
                    raise errors.AlreadyExists(f"key {new.key_id} is already in the chain")
                record, ends = self._endorse(new, ref, previous, overlap)
                count = self._store.rotate_signing_key(
                    record,
                    previous=previous.key_id,
                    previous_not_after=ends,
                    resign=lambda body: (new.sign_bytes(body), new.key_id),
                )
            except BaseException:
                if made is not None:
                    made.unlink(missing_ok=True)  # never left behind unregistered
                raise
            self._signers[new.key_id] = new
            self._refresh()
        # A push that signed with the old key and committed while the rotation ran was
        # not seen by it; pushes committed later re-sign themselves (`settle`).
        count += self._store.resign_manifests(
            new.key_id, lambda body: (new.sign_bytes(body), new.key_id)
        )
        return replace(current, not_after=ends), record, count

    def _new_signer(self, new_key: str) -> tuple[Signer, str, Path | None]:
        if new_key:
            kms_key = parse_kms_url(new_key)
            signer = KmsSigner(kms_key, endpoint_url=self._kms_endpoint, region=self._kms_region)
            return signer, KMS_SCHEME + kms_key, None
        signer, path = ManifestSigner.create_in(self._keys_dir)
        return signer, str(path), path

    def _endorse(
        self, new: Signer, ref: str, previous: Signer, overlap: dt.timedelta
    ) -> tuple[SigningKeyRecord, dt.datetime]:
        """Return the new key's record, endorsed by `previous`, and when `previous` ends."""
        now = self._clock().replace(microsecond=0)
        ends = now + overlap
        pem = new.public_key_pem()
        body = endorsement_body(
            key_id=new.key_id,
            public_key_pem=pem,
            created_at=now,
            endorsed_by=previous.key_id,
            endorser_not_after=ends,
        )
        record = SigningKeyRecord(
            key_id=new.key_id,
            public_key_pem=pem,
            private_key_ref=ref,
            created_at=now,
            not_after=None,
            endorsement=body,
            endorsement_signature=previous.sign_bytes(body),
            endorsed_by=previous.key_id,
        )
        return record, ends

    def settle(self, signed_by: str) -> int:
        """Re-sign manifests if `signed_by` is no longer active (a push raced a rotation)."""
        with self._lock:
            self._refresh()
        active = self.active()
        if signed_by == active.key_id:
            return 0
        return self._store.resign_manifests(
            active.key_id, lambda body: (active.sign_bytes(body), active.key_id)
        )
