"""Signed model manifests (digests, sizes, model signature) and assignments.

The signed bytes are the manifest's canonical JSON, so signer and verifier never
disagree about what was signed, and `verify_manifest` only accepts bodies already in
that form (a body with duplicate or reordered keys is refused even if signed). A
`Signer` is an Ed25519 key file (`ManifestSigner`) or an asymmetric KMS key
(`kms_signer.KmsSigner`); verifiers accept both kinds.
"""

from __future__ import annotations

import abc
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from contract import errors

# One definition of each, used by both sides.
from contract.assignment import (
    AssignmentRejected,
    PublicKey,
    canonical_json,
    key_id_of,
    load_public_key,
    signature_valid,
)
from contract.key_files import read_private_file, write_private_file

_BAD_SIGNATURE = "manifest signature does not verify"


@dataclass(frozen=True)
class SignedManifest:
    """A canonical manifest body, its Ed25519 signature, and the signing key's id."""

    body: bytes
    signature: bytes = field(repr=False)
    key_id: str


class Signer(abc.ABC):
    """Signs canonical JSON documents with one key whose public half verifiers pin."""

    @property
    @abc.abstractmethod
    def key_id(self) -> str:
        """Return the public key's id (`contract.assignment.key_id_of`)."""

    @abc.abstractmethod
    def public_key_pem(self) -> bytes:
        """Return the public key as PEM SubjectPublicKeyInfo, for verifiers."""

    @abc.abstractmethod
    def sign_bytes(self, body: bytes) -> bytes:
        """Sign `body` exactly (Ed25519, or ECDSA P-256 over SHA-256)."""

    def sign(self, manifest: dict[str, Any]) -> SignedManifest:
        """Sign the canonical JSON of `manifest`."""
        body = canonical_json(manifest)
        return SignedManifest(body, self.sign_bytes(body), self.key_id)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(key_id={self.key_id!r})"


class ManifestSigner(Signer):
    """Signs with an Ed25519 private key kept in a 0600 PEM (PKCS#8) file."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self._key_id = key_id_of(private_key.public_key())

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> ManifestSigner:
        """Generate a key and write it to `path` (mode 0600); fail if `path` exists."""
        signer = cls(Ed25519PrivateKey.generate())
        signer._write(Path(path))
        return signer

    @classmethod
    def create_in(cls, directory: str | os.PathLike[str]) -> tuple[ManifestSigner, Path]:
        """Generate a key into `directory`/signing_ed25519_<key id>.pem (mode 0600)."""
        signer = cls(Ed25519PrivateKey.generate())
        path = Path(directory) / f"signing_ed25519_{signer.key_id}.pem"
        signer._write(path)
        return signer, path

    def _write(self, path: Path) -> None:
        pem = self._private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),  # protected by file mode, like the local KEK
        )
        write_private_file(path, pem, replace=False)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ManifestSigner:
        """Read the key at `path`, refusing a file that group or others may access."""
        pem = read_private_file(Path(path))
        try:
            private_key = serialization.load_pem_private_key(pem, password=None)
        except (ValueError, TypeError):
            raise errors.InvalidArgument(f"{path} is not an unencrypted PEM private key") from None
        if not isinstance(private_key, Ed25519PrivateKey):
            raise errors.InvalidArgument(f"{path} does not hold an Ed25519 key")
        return cls(private_key)

    @property
    def key_id(self) -> str:
        """Return the public key's id (see `key_id_of`)."""
        return self._key_id

    def public_key_pem(self) -> bytes:
        """Return the public key as PEM SubjectPublicKeyInfo, for verifiers."""
        return self._private_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign_bytes(self, body: bytes) -> bytes:
        """Sign `body` with Ed25519."""
        return self._private_key.sign(body)


def verify_manifest(body: bytes, signature: bytes, public_key_pem: bytes) -> dict[str, Any]:
    """Return the parsed manifest if `signature` over `body` verifies, else IntegrityError."""
    if not signature_valid(_load_public_key(public_key_pem), signature, body):
        raise errors.IntegrityError(_BAD_SIGNATURE)
    try:
        manifest = json.loads(body)
    except ValueError:  # includes UnicodeDecodeError
        raise errors.IntegrityError("signed manifest is not JSON") from None
    if not isinstance(manifest, dict) or canonical_json(manifest) != body:
        raise errors.IntegrityError("signed manifest is not a canonical JSON object")
    return manifest


def _load_public_key(public_key_pem: bytes) -> PublicKey:
    try:
        return load_public_key(public_key_pem)
    except AssignmentRejected as exc:
        raise errors.InvalidArgument(str(exc)) from None
