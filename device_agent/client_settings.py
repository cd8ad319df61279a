"""The TLS an agent dials its control plane with, from its flag, the environment or skiff.json.

`skiff agent run` reads the same three client settings the operator's commands read, in
the same order (the `--ca` flag, then SKIFF_CA / SKIFF_TLS_CLIENT_CERT /
SKIFF_TLS_CLIENT_KEY, then the home folder's `skiff.json`), and refuses a bad file in
the same words, so a device configured for either keeps working. A device-only install
has no control_plane.settings, so the few lines that resolve these three live here.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

from contract import errors
from contract.transport import ClientTls, pem_problem

# Setting name -> its environment variable (control_plane.settings declares the same).
_ENV = {
    "tls_ca": "SKIFF_CA",
    "tls_client_cert": "SKIFF_TLS_CLIENT_CERT",
    "tls_client_key": "SKIFF_TLS_CLIENT_KEY",
}


def client_tls(*, ca_flag: str | None, environ=None, home: Path | None = None) -> ClientTls:
    """Return what the agent trusts (the CA) and presents (a client pair) to its server."""
    environ = os.environ if environ is None else environ
    home = Path(home or environ.get("SKIFF_HOME") or Path.home() / ".skiff")
    stored = _config_file(home.expanduser().resolve())
    value = {
        name: str(
            (ca_flag if name == "tls_ca" else None) or environ.get(env) or stored.get(name) or ""
        )
        for name, env in _ENV.items()
    }
    ca, cert, key = value["tls_ca"], value["tls_client_cert"], value["tls_client_key"]
    if bool(cert) != bool(key):
        raise errors.InvalidArgument("tls_client_cert and tls_client_key go together")
    private_key = _check_key_pair(cert, key) if cert else None
    return ClientTls(
        root_certificates=_read_ca(ca) if ca else None,
        private_key=private_key,
        certificate_chain=_read(cert, "tls_client_cert") if cert else None,
    )


def _config_file(home: Path) -> dict:
    path = home / "skiff.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise errors.InvalidArgument(f"cannot read {path}: {exc}") from None
    return {k: v for k, v in data.items() if k in _ENV}


def _read_ca(path: str) -> bytes:
    """Read the CA, refusing what is not PEM (gRPC would only fail every handshake later)."""
    data = _read(path, "the CA (--ca or SKIFF_CA)")
    if problem := pem_problem(data):
        raise errors.InvalidArgument(f"the CA {path} (--ca or SKIFF_CA) is {problem}")
    return data


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None


def _check_key_pair(cert_path: str, key_path: str) -> bytes:
    """Return the key at `key_path`, refusing one that is not `cert_path`'s own.

    gRPC only says "Failed to create security handshaker" for a mismatched pair.
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        cert = x509.load_pem_x509_certificate(Path(cert_path).read_bytes())
    except FileNotFoundError:
        raise errors.NotFound(f"TLS certificate {cert_path} does not exist") from None
    except ValueError:
        raise errors.InvalidArgument(f"{cert_path} is not a PEM certificate") from None
    data = _read_private(Path(key_path))
    try:
        key = serialization.load_pem_private_key(data, None)
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"cannot read the TLS key {key_path}: {exc}") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise errors.InvalidArgument(f"the TLS key {key_path} does not match {cert_path}")
    return data


def _read_private(path: Path) -> bytes:
    """Read a key file, refusing one that group or others can access (like ssh does)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise errors.NotFound(f"key file {path} does not exist") from None
    with os.fdopen(fd, "rb") as f:
        mode = stat.S_IMODE(os.fstat(f.fileno()).st_mode)  # fstat: the file we read
        if mode & 0o077:
            raise errors.InvalidArgument(
                f"key file {path} has mode {mode:04o}; it must not be accessible by group "
                "or others (chmod 600)"
            )
        return f.read()
