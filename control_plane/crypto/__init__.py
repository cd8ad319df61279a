"""Envelope encryption of artifacts, key-encryption keys, and signed manifests."""

from control_plane.crypto.envelope import (
    SEGMENT_SIZE,
    ciphertext_size,
    decrypt_stream,
    encrypt_chunks,
    encrypt_stream,
    new_data_key,
)
from control_plane.crypto.kek import (
    AwsKmsKek,
    KeyEncryptionKey,
    LocalKek,
    WrappedKey,
    open_kek,
    rewrap,
)
from control_plane.crypto.signing import (
    ManifestSigner,
    SignedManifest,
    canonical_json,
    verify_manifest,
)

__all__ = [
    "SEGMENT_SIZE",
    "AwsKmsKek",
    "KeyEncryptionKey",
    "LocalKek",
    "ManifestSigner",
    "SignedManifest",
    "WrappedKey",
    "canonical_json",
    "ciphertext_size",
    "decrypt_stream",
    "encrypt_chunks",
    "encrypt_stream",
    "new_data_key",
    "open_kek",
    "rewrap",
    "verify_manifest",
]
