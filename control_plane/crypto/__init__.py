"""Envelope encryption of artifacts, key-encryption keys, and signed manifests.

The envelope (Tink) and the key-encryption keys (`kek`: boto3 for AWS KMS) load on first
use: the device agent decrypts artifacts with `decrypt_stream` and never needs the keys,
nor their memory, and an operator's command that only reads the TLS files
(`control_plane.crypto.tls`) loads neither.
"""

import importlib
from typing import Any

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

_KEK_NAMES = ("AwsKmsKek", "KeyEncryptionKey", "LocalKek", "WrappedKey", "open_kek", "rewrap")
_ENVELOPE_NAMES = (
    "SEGMENT_SIZE",
    "ciphertext_size",
    "decrypt_stream",
    "encrypt_chunks",
    "encrypt_stream",
    "new_data_key",
)
_LAZY = dict.fromkeys(_KEK_NAMES, "control_plane.crypto.kek")
_LAZY |= dict.fromkeys(_ENVELOPE_NAMES, "contract.envelope")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
