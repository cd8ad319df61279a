from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from contract import errors
from control_plane.crypto import ManifestSigner, SignedManifest, verify_manifest

MANIFEST = {
    "model": "resnet",
    "version": 3,
    "artifacts": [{"variant": "int8", "sha256": "ab" * 32, "size": 1234}],
    "note": "café",
}


@pytest.fixture
def key_path(tmp_path: Path) -> Path:
    return tmp_path / "signing.pem"


@pytest.fixture
def signer(key_path: Path) -> ManifestSigner:
    return ManifestSigner.create(key_path)


def test_create_writes_private_pkcs8_pem(signer: ManifestSigner, key_path: Path) -> None:
    assert stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert key_path.read_bytes().startswith(b"-----BEGIN PRIVATE KEY-----")
    with pytest.raises(errors.AlreadyExists):
        ManifestSigner.create(key_path)


def test_load_round_trip_and_key_id(signer: ManifestSigner, key_path: Path) -> None:
    loaded = ManifestSigner.load(key_path)
    assert loaded.key_id == signer.key_id
    assert loaded.public_key_pem() == signer.public_key_pem()
    public = serialization.load_pem_public_key(signer.public_key_pem())
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    assert signer.key_id == hashlib.sha256(raw).hexdigest()[:16]


def test_load_refuses_world_readable(signer: ManifestSigner, key_path: Path) -> None:
    os.chmod(key_path, 0o644)
    with pytest.raises(errors.InvalidArgument, match="0644"):
        ManifestSigner.load(key_path)


def test_sign_and_verify(signer: ManifestSigner) -> None:
    signed = signer.sign(MANIFEST)
    assert isinstance(signed, SignedManifest)
    assert signed.key_id == signer.key_id
    assert signed.body == json.dumps(MANIFEST, sort_keys=True, separators=(",", ":")).encode()
    assert b"caf\\u00e9" in signed.body  # ensure_ascii
    assert verify_manifest(signed.body, signed.signature, signer.public_key_pem()) == MANIFEST


def test_body_is_canonical_whatever_the_key_order(signer: ManifestSigner) -> None:
    reordered = dict(reversed(list(MANIFEST.items())))
    assert signer.sign(reordered).body == signer.sign(MANIFEST).body


def test_tampered_body_fails(signer: ManifestSigner) -> None:
    signed = signer.sign(MANIFEST)
    tampered = signed.body.replace(b'"size":1234', b'"size":1235')
    assert tampered != signed.body
    with pytest.raises(errors.IntegrityError, match="manifest signature does not verify"):
        verify_manifest(tampered, signed.signature, signer.public_key_pem())


def test_tampered_signature_fails(signer: ManifestSigner) -> None:
    signed = signer.sign(MANIFEST)
    signature = bytearray(signed.signature)
    signature[10] ^= 0x01
    for bad in (bytes(signature), signed.signature[:-1], b""):
        with pytest.raises(errors.IntegrityError, match="does not verify"):
            verify_manifest(signed.body, bad, signer.public_key_pem())


def test_other_key_fails(signer: ManifestSigner, tmp_path: Path) -> None:
    other = ManifestSigner.create(tmp_path / "other.pem")
    signed = signer.sign(MANIFEST)
    with pytest.raises(errors.IntegrityError):
        verify_manifest(signed.body, signed.signature, other.public_key_pem())


def test_signed_but_non_canonical_body_fails(signer: ManifestSigner, key_path: Path) -> None:
    private_key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    for body in (b'{"a": 1}', b'{"a":1,"a":2}', b"[1]", b"\xff"):
        with pytest.raises(errors.IntegrityError):
            verify_manifest(body, private_key.sign(body), signer.public_key_pem())


def test_bad_public_key_is_invalid_argument(signer: ManifestSigner) -> None:
    signed = signer.sign(MANIFEST)
    with pytest.raises(errors.InvalidArgument):
        verify_manifest(signed.body, signed.signature, b"not a key")


def test_private_key_not_in_repr(signer: ManifestSigner, key_path: Path) -> None:
    pem_lines = key_path.read_text().splitlines()[1:-1]
    private_key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    raw = private_key.private_bytes(
        serialization.Encoding.Raw, serialization.PrivateFormat.Raw, serialization.NoEncryption()
    )
    texts = [repr(signer), str(signer), repr(signer.sign(MANIFEST))]
    for text in texts:
        assert signer.key_id in texts[0]
        assert raw.hex() not in text
        assert all(line not in text for line in pem_lines)
