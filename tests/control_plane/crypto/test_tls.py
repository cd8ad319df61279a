"""The home's CA and server certificate: what init makes, and which certificates we refuse."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
from dataclasses import replace

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization

from contract import errors
from control_plane.api.transport import init_tls
from control_plane.crypto import tls as certs
from control_plane.settings import load_config


@pytest.fixture
def made(tmp_path):
    home = tmp_path / "home"
    (home / "keys").mkdir(parents=True)
    config = load_config(home, {"grpc": "0.0.0.0:7443", "server": "skiff.lan:7443"}, environ={})
    return init_tls(config, ["myhost.example", "192.168.1.20"])


def _cert(path: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(open(path, "rb").read())


def test_ca_is_a_ca_and_signs_the_server_certificate(made):
    ca = _cert(made.tls_ca)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and not usage.digital_signature
    assert ca.not_valid_after_utc - ca.not_valid_before_utc > dt.timedelta(days=3650)
    server = _cert(made.tls_cert)
    server.verify_directly_issued_by(ca)
    assert not server.extensions.get_extension_for_class(x509.BasicConstraints).value.ca


def test_server_certificate_names_loopback_the_addresses_and_the_extra_names(made):
    sans = _cert(made.tls_cert).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    dns = set(sans.value.get_values_for_type(x509.DNSName))
    ips = set(sans.value.get_values_for_type(x509.IPAddress))
    assert dns == {"localhost", "skiff.lan", "myhost.example"}  # 0.0.0.0 names nothing
    assert ips == {ipaddress.ip_address(a) for a in ("127.0.0.1", "::1", "192.168.1.20")}


def test_private_keys_are_0600_and_the_ca_key_is_written_once(made):
    paths = certs.HomeTls.of(made.home)
    for key in (paths.ca_key, paths.server_key):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600
    ca_key = paths.ca_key.read_bytes()
    holders = [p for p in made.home.rglob("*") if p.is_file() and ca_key in p.read_bytes()]
    assert holders == [paths.ca_key]
    with pytest.raises(errors.AlreadyExists):
        certs.create_home_tls(made.home, [])


def test_own_certificate_is_checked_against_its_key_its_dates_and_its_ca(made, tmp_path):
    certs.check_server_pair(made.tls_cert, made.tls_key, made.tls_ca)
    other = init_tls(replace(made, home=tmp_path / "other", tls_cert="", tls_key="", tls_ca=""))
    with pytest.raises(errors.InvalidArgument, match="does not match"):
        certs.check_server_pair(made.tls_cert, other.tls_key)
    with pytest.raises(errors.InvalidArgument, match="not signed by the CA"):
        certs.check_server_pair(made.tls_cert, made.tls_key, other.tls_ca)
    later = dt.datetime.now(dt.UTC) + dt.timedelta(days=6 * 365)
    with pytest.raises(errors.InvalidArgument, match="valid only from"):
        certs.check_server_pair(made.tls_cert, made.tls_key, now=later)


def test_init_refuses_half_of_an_own_pair_and_bad_names(made, tmp_path):
    fresh = replace(made, home=tmp_path / "fresh", tls_cert="", tls_key="", tls_ca="")
    with pytest.raises(errors.InvalidArgument, match="go together"):
        init_tls(replace(fresh, tls_cert=made.tls_cert))
    with pytest.raises(errors.InvalidArgument, match="not a host name"):
        init_tls(fresh, ["bad name\u0000"])
    assert not (tmp_path / "fresh").exists()  # refused before anything was written
    # An own pair is used as given: nothing generated.
    own = init_tls(replace(fresh, tls_cert=made.tls_cert, tls_key=made.tls_key))
    assert own.tls_cert == made.tls_cert and not (tmp_path / "fresh").exists()


def test_a_group_readable_ca_key_is_refused(made):
    paths = certs.HomeTls.of(made.home)
    paths.ca_key.chmod(0o640)
    with pytest.raises(errors.InvalidArgument, match="chmod 600"):
        certs.load_ca(paths)
    paths.ca_key.chmod(0o600)
    key, cert = certs.load_ca(paths)
    assert key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) == cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
