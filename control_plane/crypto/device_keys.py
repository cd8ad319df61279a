"""Data keys wrapped to one device: HPKE (RFC 9180) through Tink's hybrid primitives.

Each device makes its own key pair (DHKEM_X25519_HKDF_SHA256, HKDF_SHA256, AES_256_GCM)
and sends only the public keyset when it enrolls. A version's data key is encrypted to
that public key with a context naming the device and the version (`wrap_context`, defined
once on the device side), so a wrapped key copied to another device, or onto another
version, does not open.
"""

from __future__ import annotations

import tink
from google.protobuf.message import DecodeError
from tink import hybrid
from tink.proto import hpke_pb2, tink_pb2

from contract import errors
from contract.key_wrap import wrap_context

__all__ = ["check_public_keyset", "device_encrypter", "wrap_context"]

hybrid.register()

_PUBLIC_TYPE_URL = "type.googleapis.com/google.crypto.tink.HpkePublicKey"
MAX_KEYSET_BYTES = 1024


def check_public_keyset(keyset: bytes) -> bytes:
    """Return `keyset` if it is one X25519/HKDF-SHA256/AES-256-GCM HPKE public key.

    Anything else (a private key, several keys, other parameters, junk) is refused, so a
    device cannot choose weaker parameters or hand over its private key by mistake.
    """
    if not keyset or len(keyset) > MAX_KEYSET_BYTES:
        raise errors.InvalidArgument("public_keyset is empty or too large")
    try:
        parsed = tink_pb2.Keyset.FromString(keyset)
        if len(parsed.key) != 1 or parsed.key[0].key_data.type_url != _PUBLIC_TYPE_URL:
            raise ValueError("expected exactly one HpkePublicKey")
        key = hpke_pb2.HpkePublicKey.FromString(parsed.key[0].key_data.value)
        p = key.params
        if (
            p.kem != hpke_pb2.DHKEM_X25519_HKDF_SHA256
            or p.kdf != hpke_pb2.HKDF_SHA256
            or p.aead != hpke_pb2.AES_256_GCM
            or len(key.public_key) != 32
        ):
            raise ValueError("unexpected HPKE parameters")
        tink.proto_keyset_format.parse_without_secret(keyset).primitive(hybrid.HybridEncrypt)
    except (ValueError, DecodeError, tink.TinkError):
        raise errors.InvalidArgument(
            "public_keyset is not one Tink HPKE public key "
            "(DHKEM_X25519_HKDF_SHA256, HKDF_SHA256, AES_256_GCM)"
        ) from None
    return keyset


def device_encrypter(public_keyset: bytes) -> hybrid.HybridEncrypt:
    """Return the HPKE primitive that encrypts to a device (parse once, use many times)."""
    return tink.proto_keyset_format.parse_without_secret(public_keyset).primitive(
        hybrid.HybridEncrypt
    )
