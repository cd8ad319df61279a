"""A device's own key pair: HPKE (X25519, HKDF-SHA256, AES-256-GCM) through Tink.

The device makes the pair, keeps the private half (0600, never sent) and enrolls with the
public half. The control plane wraps each version's data key to it, bound to the device id
and the version uid (`wrap_context`), so a wrapped key only opens here, for that version.
This module is the one definition both sides use: the control plane imports
`wrap_context` and `HPKE_TEMPLATE` from it.
"""

from __future__ import annotations

import tink
from tink import hybrid, secret_key_access

hybrid.register()

HPKE_TEMPLATE = hybrid.hybrid_key_templates.DHKEM_X25519_HKDF_SHA256_HKDF_SHA256_AES_256_GCM_RAW


class KeyUnwrapError(Exception):
    """A wrapped data key did not open with this device's key (wrong device or version)."""


def wrap_context(device_id: str, version_uid: str) -> bytes:
    """Return the HPKE context info binding a wrapped key to one device and one version."""
    return f"skiff/device-key/v1:{device_id}:{version_uid}".encode()


class DeviceKeyPair:
    """A device's HPKE key pair."""

    def __init__(self, handle: tink.KeysetHandle) -> None:
        self._handle = handle
        self._decrypt = handle.primitive(hybrid.HybridDecrypt)

    @classmethod
    def generate(cls) -> DeviceKeyPair:
        """Make a fresh key pair."""
        return cls(tink.new_keyset_handle(HPKE_TEMPLATE))

    @classmethod
    def from_private(cls, keyset: bytes) -> DeviceKeyPair:
        """Load a key pair from its serialized private keyset (secret)."""
        return cls(tink.proto_keyset_format.parse(keyset, secret_key_access.TOKEN))

    def private_keyset(self) -> bytes:
        """Return the serialized private keyset (secret: store it 0600)."""
        return tink.proto_keyset_format.serialize(self._handle, secret_key_access.TOKEN)

    def public_keyset(self) -> bytes:
        """Return the serialized public keyset: what Enroll sends."""
        return tink.proto_keyset_format.serialize_without_secret(
            self._handle.public_keyset_handle()
        )

    def unwrap(self, wrapped: bytes, *, device_id: str, version_uid: str) -> bytes:
        """Open a data key wrapped to this device for `version_uid`."""
        try:
            return self._decrypt.decrypt(wrapped, wrap_context(device_id, version_uid))
        except tink.TinkError:
            raise KeyUnwrapError("wrapped data key does not open with this device key") from None

    def __repr__(self) -> str:
        return "DeviceKeyPair(<secret>)"
