"""The signing-key store interface: the chain of keys that sign manifests and assignments.

Shared by every replica through the database, so all of them sign with the same active
key (the newest in the chain). Private keys are never stored: a row names where the key
lives (`private_key_ref`: a 0600 file path or an ``aws-kms://`` key).
"""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SigningKeyRecord:
    """One key of the chain; the first has no endorsement."""

    key_id: str
    public_key_pem: bytes = field(repr=False)
    private_key_ref: str
    created_at: dt.datetime
    not_after: dt.datetime | None
    endorsement: bytes = field(repr=False)
    endorsement_signature: bytes = field(repr=False)
    endorsed_by: str


# Signs one stored manifest body again; returns (signature, key id).
Resigner = Callable[[bytes], tuple[bytes, str]]


class SigningKeyStore(abc.ABC):
    """Persistent chain of signing keys."""

    @abc.abstractmethod
    def signing_keys(self) -> list[SigningKeyRecord]:
        """Return the chain, oldest first; the last key is the active one."""

    @abc.abstractmethod
    def add_root_signing_key(self, root: SigningKeyRecord) -> list[SigningKeyRecord]:
        """Register `root` if the chain is empty (else leave it); returns the chain."""

    @abc.abstractmethod
    def rotate_signing_key(
        self,
        new: SigningKeyRecord,
        *,
        previous: str,
        previous_not_after: dt.datetime,
        resign: Resigner,
    ) -> int:
        """Append `new` after `previous`, end `previous`, re-sign every other manifest.

        All in one transaction; FailedPrecondition when `previous` is no longer active
        (another replica rotated first). Returns how many manifests were re-signed.
        """

    @abc.abstractmethod
    def resign_manifests(self, key_id: str, resign: Resigner) -> int:
        """Re-sign every manifest not signed by `key_id`; returns how many."""
