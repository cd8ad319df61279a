"""The KMS signer against moto's KMS over HTTP: only verified P-256 signing keys sign."""

from __future__ import annotations

import boto3
import pytest

from contract import errors
from contract.assignment import key_id_of, load_public_key
from control_plane.crypto import verify_manifest
from control_plane.crypto.kms_signer import KmsSigner, parse_kms_url

MANIFEST = {"model": "det", "version": 1, "variants": {"fp32": {"plaintext_size": 10}}}


def _key(endpoint: str, **spec) -> str:
    kms = boto3.client("kms", endpoint_url=endpoint, region_name="us-east-1")
    return kms.create_key(Description="skiff test signing key", **spec)["KeyMetadata"]["Arn"]


@pytest.fixture
def p256_key(moto_endpoint: str) -> str:
    return _key(moto_endpoint, KeySpec="ECC_NIST_P256", KeyUsage="SIGN_VERIFY")


def test_signs_what_verifiers_accept(moto_endpoint: str, p256_key: str) -> None:
    signer = KmsSigner(p256_key, endpoint_url=moto_endpoint)
    assert signer.key_id == key_id_of(load_public_key(signer.public_key_pem()))
    signed = signer.sign(MANIFEST)
    assert signed.key_id == signer.key_id
    assert verify_manifest(signed.body, signed.signature, signer.public_key_pem()) == MANIFEST
    with pytest.raises(errors.IntegrityError):
        verify_manifest(
            signed.body.replace(b"10", b"11"), signed.signature, signer.public_key_pem()
        )


@pytest.mark.parametrize(
    "spec",
    [
        {},  # symmetric ENCRYPT_DECRYPT: a KEK, not a signing key
        {"KeySpec": "RSA_2048", "KeyUsage": "SIGN_VERIFY"},
        {"KeySpec": "ECC_NIST_P384", "KeyUsage": "SIGN_VERIFY"},
        {"KeySpec": "ECC_SECG_P256K1", "KeyUsage": "SIGN_VERIFY"},
    ],
)
def test_refuses_keys_of_any_other_spec(moto_endpoint: str, spec: dict) -> None:
    with pytest.raises(errors.InvalidArgument, match="ECC_NIST_P256"):
        KmsSigner(_key(moto_endpoint, **spec), endpoint_url=moto_endpoint)


def test_unknown_key_is_not_found(moto_endpoint: str) -> None:
    with pytest.raises(errors.NotFound):
        KmsSigner("alias/no-such-key", endpoint_url=moto_endpoint, region="us-east-1")


def test_urls_never_carry_an_endpoint() -> None:
    assert parse_kms_url("aws-kms://alias/skiff") == "alias/skiff"
    arn = "arn:aws:kms:us-east-1:123456789012:key/1234abcd"
    assert parse_kms_url(f"aws-kms://{arn}") == arn
    for bad in ("aws-kms://", "aws-kms://k?endpoint_url=http://x", "kms://k", "aws-kms://k#x"):
        with pytest.raises(errors.InvalidArgument, match="kms_endpoint"):
            parse_kms_url(bad)
