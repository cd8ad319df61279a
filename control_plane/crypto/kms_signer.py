"""A manifest and assignment signer whose private key never leaves AWS KMS.

Only one key spec is used: ECC_NIST_P256 with ECDSA_SHA_256 (what every verifier
supports besides Ed25519, and what moto implements). The key's spec, usage and public
key are checked once, when the signer is opened, so Skiff never signs with a key whose
scheme it has not verified; each signature KMS returns is verified locally against that
public key before it is used, so a misbehaving endpoint cannot slip in a bad one.
"""

from __future__ import annotations

import hashlib

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from contract import errors
from contract.assignment import key_id_of, signature_valid
from control_plane.crypto.kek import call_kms, kms_client  # one KMS client policy
from control_plane.crypto.signing import Signer

KMS_SCHEME = "aws-kms://"
KEY_SPEC = "ECC_NIST_P256"
ALGORITHM = "ECDSA_SHA_256"
# KMS signs a RAW message of at most 4096 bytes; longer documents go as their SHA-256
# with MessageType DIGEST, which yields the same ECDSA-SHA-256 signature.
_RAW_LIMIT = 4096


def parse_kms_url(url: str) -> str:
    """Return the key id or ARN of ``aws-kms://KEY``; the endpoint never comes from a URL."""
    key_id = url.removeprefix(KMS_SCHEME)
    if not url.startswith(KMS_SCHEME) or not key_id or any(c in key_id for c in "?#& \t"):
        raise errors.InvalidArgument(
            "a KMS signing key is aws-kms://KEY-ID, ARN or alias/NAME (the endpoint and "
            "region come from the server's kms_endpoint and kms_region settings)"
        )
    return key_id


class KmsSigner(Signer):
    """Signs with an asymmetric ECC_NIST_P256 KMS key (ECDSA over SHA-256)."""

    def __init__(self, key_id: str, *, endpoint_url: str = "", region: str = "") -> None:
        self._kms_key = key_id
        if not region and key_id.startswith("arn:"):
            region = key_id.split(":")[3]  # an ARN names its region
        self._kms = kms_client(endpoint_url or None, region or None, what="KMS key")
        self._public_key = self._checked_public_key()
        self._key_id = key_id_of(self._public_key)

    def _checked_public_key(self) -> ec.EllipticCurvePublicKey:
        meta = self._call("get_public_key", KeyId=self._kms_key)
        spec = meta.get("KeySpec") or meta.get("CustomerMasterKeySpec")
        if meta.get("KeyUsage") != "SIGN_VERIFY" or spec != KEY_SPEC:
            raise errors.InvalidArgument(
                f"KMS key {self._kms_key} is {spec} for {meta.get('KeyUsage')}; a signing "
                f"key must be {KEY_SPEC} for SIGN_VERIFY"
            )
        if ALGORITHM not in meta.get("SigningAlgorithms", ()):
            raise errors.InvalidArgument(f"KMS key {self._kms_key} does not offer {ALGORITHM}")
        key = serialization.load_der_public_key(meta["PublicKey"])
        if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(
            key.curve, ec.SECP256R1
        ):
            raise errors.InvalidArgument(f"KMS key {self._kms_key} is not a P-256 key")
        return key

    @property
    def kms_key(self) -> str:
        """Return the KMS key id or ARN this signer uses."""
        return self._kms_key

    @property
    def key_id(self) -> str:
        """Return the public key's id."""
        return self._key_id

    def public_key_pem(self) -> bytes:
        """Return the public key as PEM SubjectPublicKeyInfo."""
        return self._public_key.public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )

    def sign_bytes(self, body: bytes) -> bytes:
        """Sign `body` in KMS and check the signature before returning it."""
        if len(body) <= _RAW_LIMIT:
            message, kind = body, "RAW"
        else:
            message, kind = hashlib.sha256(body).digest(), "DIGEST"
        response = self._call(
            "sign",
            KeyId=self._kms_key,
            Message=message,
            MessageType=kind,
            SigningAlgorithm=ALGORITHM,
        )
        signature = response["Signature"]
        if not signature_valid(self._public_key, signature, body):
            raise errors.IntegrityError(f"KMS key {self._kms_key} returned a bad signature")
        return signature

    def _call(self, operation: str, **kwargs: object) -> dict:
        return call_kms(
            self._kms,
            operation,
            subject=f"aws-kms:{self._kms_key}",
            integrity=f"KMS {operation} failed authentication",
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"KmsSigner(kms_key={self._kms_key!r}, key_id={self._key_id!r})"
