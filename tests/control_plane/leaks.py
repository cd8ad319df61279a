"""Find a secret in logs or output in any form it could be written: a test helper.

A data key is a serialized Tink keyset; the AES key inside it is what really matters.
Either could be logged raw, as hex, as base64 (standard or URL-safe, padded or not, on
its own or inside a longer base64 blob), or as a Python repr.
"""

from __future__ import annotations

import base64

from tink.proto import aes_gcm_hkdf_streaming_pb2, tink_pb2


def key_material(data_key: bytes) -> dict[str, bytes]:
    """Return the secrets inside a data key: the keyset and each key value in it."""
    found = {"keyset": data_key}
    for i, key in enumerate(tink_pb2.Keyset.FromString(data_key).key):
        inner = aes_gcm_hkdf_streaming_pb2.AesGcmHkdfStreamingKey.FromString(key.key_data.value)
        found[f"key value {i}"] = inner.key_value
    return found


def _base64_cores(secret: bytes) -> dict[str, str]:
    """Base64 text that any encoding of a blob containing `secret` must contain.

    Base64 works on 3-byte groups, so a secret inside a longer blob is encoded in one
    of three alignments; for each, keep only the characters that depend on the secret
    alone (not on the bytes around it).
    """
    cores = {}
    for shift in range(3):
        text = base64.b64encode(bytes(shift) + secret).decode()
        start = -(-shift * 4 // 3)  # characters still touched by the padding bytes
        end = (shift + len(secret)) // 3 * 4  # a partial last group depends on what follows
        core = text[start:end]
        cores[f"base64 (alignment {shift})"] = core
        cores[f"urlsafe base64 (alignment {shift})"] = core.replace("+", "-").replace("/", "_")
    return cores


def leak_forms(secret: bytes) -> dict[str, str]:
    """Return every textual form of `secret` worth searching for, by name."""
    return {
        "raw (latin-1)": secret.decode("latin-1"),
        "raw (utf-8, replaced)": secret.decode("utf-8", "backslashreplace"),
        "hex": secret.hex(),
        "HEX": secret.hex().upper(),
        "repr": repr(secret),
        "repr body": repr(secret)[2:-1],
        **_base64_cores(secret),
    }


def find_leaks(text: str, data_key: bytes) -> list[str]:
    """Return the names of the forms of `data_key`'s secrets that occur in `text`."""
    return [
        f"{what} as {form}"
        for what, secret in key_material(data_key).items()
        for form, needle in leak_forms(secret).items()
        if needle and needle in text
    ]
