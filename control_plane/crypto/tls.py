"""TLS certificates for the gRPC port: a home's own CA and the certificates it signs.

`skiff init` makes a CA (ECDSA P-256) and a server certificate signed by it, so the
embedded default speaks TLS from the first start; clients trust the CA's certificate,
which is public and meant to be copied. The CA's private key stays in the home's
`keys/` (mode 0600) and nowhere else. A user may bring their own certificate instead;
`check_server_pair` refuses one whose key does not match or that is not valid now.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from contract import errors
from contract.key_files import (
    check_key_pair,
    load_certificate,
    read_private_file,
    write_private_file,
)

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")
# The names every server certificate carries: clients on the same machine dial these.
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
CA_LIFETIME = dt.timedelta(days=20 * 365)
# Long enough that an unattended fleet does not lose its server to an expiry; renewing
# means re-issuing from the same CA, which devices keep trusting.
SERVER_LIFETIME = dt.timedelta(days=5 * 365)
CLIENT_LIFETIME = dt.timedelta(days=2 * 365)
# Clocks on devices and laptops drift; a certificate made a second ago must verify.
BACKDATE = dt.timedelta(hours=1)


@dataclass(frozen=True)
class HomeTls:
    """Where a home keeps its CA and server certificate (keys under keys/, 0600)."""

    ca_cert: Path
    ca_key: Path
    server_cert: Path
    server_key: Path

    @classmethod
    def of(cls, home: Path) -> HomeTls:
        """Return the paths inside `home`."""
        return cls(
            ca_cert=home / "tls" / "ca.pem",
            ca_key=home / "keys" / "tls_ca_key.pem",
            server_cert=home / "tls" / "server.pem",
            server_key=home / "keys" / "tls_server_key.pem",
        )


def create_home_tls(home: Path, names: Iterable[str]) -> HomeTls:
    """Make a CA and a server certificate for `names` (plus loopback) inside `home`.

    Refuses to overwrite an existing CA key: a second CA would strand every client that
    trusts the first.
    """
    paths = HomeTls.of(home)
    for folder in (paths.ca_cert.parent, paths.ca_key.parent):
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    write_private_file(paths.ca_key, _key_pem(ca_key), replace=False)
    # A name of its own, so a client trusting several homes' CAs never confuses them.
    ca_cert = _ca_certificate(ca_key, f"Skiff CA {secrets.token_hex(4)} ({home.name})")
    # Certificates are public, but the same atomic writer as the keys is fine for them.
    write_private_file(
        paths.ca_cert, ca_cert.public_bytes(serialization.Encoding.PEM), replace=False
    )
    key_pem, cert_pem = issue_certificate(
        ca_key, ca_cert, common_name="skiff server", names=server_names(names)
    )
    write_private_file(paths.server_key, key_pem, replace=True)
    write_private_file(paths.server_cert, cert_pem, replace=True)
    return paths


def server_names(extra: Iterable[str]) -> list[str]:
    """Return loopback names plus `extra` (hosts from addresses, --tls-san), deduplicated."""
    names: list[str] = []
    for name in (*LOOPBACK_NAMES, *extra):
        name = name.strip().strip("[]")
        if name and name not in names and not _is_wildcard(name):
            names.append(name)
    return names


def issue_certificate(
    ca_key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    *,
    common_name: str,
    names: Sequence[str] = (),
    client: bool = False,
    now: dt.datetime | None = None,
) -> tuple[bytes, bytes]:
    """Return (key PEM, certificate PEM) for a server (SANs `names`) or a client."""
    now = now or dt.datetime.now(dt.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.CLIENT_AUTH if client else ExtendedKeyUsageOID.SERVER_AUTH
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + (CLIENT_LIFETIME if client else SERVER_LIFETIME))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signing=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    if names:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([general_name(n) for n in names]), critical=False
        )
    cert = builder.sign(ca_key, hashes.SHA256())
    return _key_pem(key), cert.public_bytes(serialization.Encoding.PEM)


def load_ca(paths: HomeTls) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """Load a home's CA key (refusing a group-readable file) and certificate."""
    key = serialization.load_pem_private_key(read_private_file(paths.ca_key), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise errors.InvalidArgument(f"{paths.ca_key} is not an ECDSA key")
    return key, x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())


def general_name(name: str) -> x509.GeneralName:
    """Return an IP SAN for an address literal, else a DNS SAN."""
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        pass
    try:
        ascii_name = name.encode("idna").decode("ascii")
    except UnicodeError:
        ascii_name = ""
    if not all(_LABEL.fullmatch(label) for label in ascii_name.split(".")):
        raise errors.InvalidArgument(f"{name!r} is not a host name or IP address")
    return x509.DNSName(ascii_name)


def check_server_pair(
    cert_path: str, key_path: str, ca_path: str = "", *, now: dt.datetime | None = None
) -> None:
    """Refuse a certificate that does not suit a server; each failure is one line.

    Refused: a key that does not match, a certificate not valid now, or one that
    `ca_path` (when given) did not sign.
    """
    now = now or dt.datetime.now(dt.UTC)
    cert = check_key_pair(cert_path, key_path)[0]
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise errors.InvalidArgument(
            f"the TLS certificate {cert_path} is valid only from "
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
        )
    if ca_path:
        try:
            cert.verify_directly_issued_by(load_certificate(ca_path))
        except (ValueError, TypeError, InvalidSignature):
            raise errors.InvalidArgument(f"{cert_path} is not signed by the CA {ca_path}") from None


def _ca_certificate(key: ec.EllipticCurvePrivateKey, name: str) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + CA_LIFETIME)
        # path_length 0: this CA signs leaf certificates only, never another CA.
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signing=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), False)
        .sign(key, hashes.SHA256())
    )


def _key_usage(*, signing: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not signing,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signing,
        crl_sign=signing,
        encipher_only=False,
        decipher_only=False,
    )


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),  # protected by file mode, like the other home keys
    )


def _is_wildcard(host: str) -> bool:
    # 0.0.0.0 and :: mean "every interface": no client dials them by that name.
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False
