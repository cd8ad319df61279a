"""Envelope encryption of artifacts, key-encryption keys, and signed manifests.

The key-encryption keys (`kek`: boto3 for AWS KMS) load on first use: the device agent
decrypts artifacts with `decrypt_stream` and never needs them, nor their memory.
"""

import importlib
from typing import Any

from contract.envelope import (
    SEGMENT_SIZE,
    ciphertext_size,
    decrypt_stream,
    encrypt_chunks,
    encrypt_stream,
    new_data_key,
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

_KEK_NAMES = frozenset(
    {"AwsKmsKek", "KeyEncryptionKey", "LocalKek", "WrappedKey", "open_kek", "rewrap"}
)


def __getattr__(name: str) -> Any:
    if name in _KEK_NAMES:
        return getattr(importlib.import_module("control_plane.crypto.kek"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
