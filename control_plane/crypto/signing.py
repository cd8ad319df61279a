"""Ed25519-signed model manifests (digests, sizes, model signature).

The signed bytes are the manifest's canonical JSON, so signer and verifier never
disagree about what was signed, and `verify_manifest` only accepts bodies already in
that form (a body with duplicate or reordered keys is refused even if signed).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from control_plane import errors
from control_plane.files import read_private_file, write_private_file
from device_agent.assignment import canonical_json  # one definition, used by both sides

_BAD_SIGNATURE = "manifest signature does not verify"


def key_id_of(public_key: Ed25519PublicKey) -> str:
    """Return the first 16 hex digits of SHA-256 over the raw 32-byte public key."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


@dataclass(frozen=True)
class SignedManifest:
    """A canonical manifest body, its Ed25519 signature, and the signing key's id."""

    body: bytes
    signature: bytes = field(repr=False)
    key_id: str


class ManifestSigner:
    """Signs manifests with an Ed25519 private key kept in a 0600 PEM (PKCS#8) file."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private_key = private_key
        self._key_id = key_id_of(private_key.public_key())

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> ManifestSigner:
        """Generate a key and write it to `path` (mode 0600); fail if `path` exists."""
        private_key = Ed25519PrivateKey.generate()
        pem = private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),  # protected by file mode, like the local KEK
        )
        write_private_file(Path(path), pem, replace=False)
        return cls(private_key)

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

    def sign(self, manifest: dict[str, Any]) -> SignedManifest:
        """Sign the canonical JSON of `manifest`."""
        body = canonical_json(manifest)
        return SignedManifest(body, self._private_key.sign(body), self._key_id)

    def __repr__(self) -> str:
        return f"ManifestSigner(key_id={self._key_id!r})"


def verify_manifest(body: bytes, signature: bytes, public_key_pem: bytes) -> dict[str, Any]:
    """Return the parsed manifest if `signature` over `body` verifies, else IntegrityError."""
    public_key = _load_public_key(public_key_pem)
    try:
        public_key.verify(signature, body)
    except InvalidSignature:
        raise errors.IntegrityError(_BAD_SIGNATURE) from None
    try:
        manifest = json.loads(body)
    except ValueError:  # includes UnicodeDecodeError
        raise errors.IntegrityError("signed manifest is not JSON") from None
    if not isinstance(manifest, dict) or canonical_json(manifest) != body:
        raise errors.IntegrityError("signed manifest is not a canonical JSON object")
    return manifest


def _load_public_key(public_key_pem: bytes) -> Ed25519PublicKey:
    try:
        public_key = serialization.load_pem_public_key(public_key_pem)
    except (ValueError, TypeError):
        raise errors.InvalidArgument("public key is not a PEM public key") from None
    if not isinstance(public_key, Ed25519PublicKey):
        raise errors.InvalidArgument("public key is not an Ed25519 key")
    return public_key
