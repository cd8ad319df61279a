"""Key, certificate and other private files, handled one careful way on both sides.

A private key readable by group or others is refused (as ssh does), a CA that is not PEM
is refused when it is read (gRPC would only fail every handshake later), and a client
certificate is checked against its key before use (gRPC says only "Failed to create
security handshaker" for a mismatched pair). The agent's `--ca` and client pair and the
operator's CLI settings go through the same functions, so they fail in the same words. A
private file is written 0600 beside its place under a fresh name, fsynced and renamed.
"""

from __future__ import annotations

import os
import stat
import tempfile
from contextlib import suppress
from pathlib import Path

from contract import errors
from contract.transport import ClientTls, pem_problem


def read_private_file(path: Path) -> bytes:
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


def read_file(path: str, what: str) -> bytes:
    """Read a file a setting names; InvalidArgument names the setting and the reason."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None


def read_ca(path: str) -> bytes:
    """Read the CA a client trusts, refusing what is not PEM."""
    data = read_file(path, "the CA (--ca or SKIFF_CA)")
    if problem := pem_problem(data):
        raise errors.InvalidArgument(f"the CA {path} (--ca or SKIFF_CA) is {problem}")
    return data


def load_certificate(path: str):
    """Return the PEM certificate at `path` (a cryptography x509.Certificate)."""
    from cryptography import x509  # deferred: only when a certificate is read

    try:
        return x509.load_pem_x509_certificate(Path(path).read_bytes())
    except FileNotFoundError:
        raise errors.NotFound(f"TLS certificate {path} does not exist") from None
    except ValueError:
        raise errors.InvalidArgument(f"{path} is not a PEM certificate") from None


def check_key_pair(cert_path: str, key_path: str):
    """Return (certificate, key PEM), refusing a key at `key_path` not `cert_path`'s own."""
    from cryptography.hazmat.primitives import serialization

    cert = load_certificate(cert_path)
    data = read_private_file(Path(key_path))
    try:
        key = serialization.load_pem_private_key(data, None)
    except (ValueError, TypeError) as exc:
        raise errors.InvalidArgument(f"cannot read the TLS key {key_path}: {exc}") from None
    spki = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    if key.public_key().public_bytes(*spki) != cert.public_key().public_bytes(*spki):
        raise errors.InvalidArgument(f"the TLS key {key_path} does not match {cert_path}")
    return cert, data


def client_tls_files(ca: str, cert: str, key: str) -> ClientTls:
    """Return what a client trusts (`ca`) and presents (`cert` + `key`); "" for none."""
    if bool(cert) != bool(key):
        raise errors.InvalidArgument("tls_client_cert and tls_client_key go together")
    private_key = check_key_pair(cert, key)[1] if cert else None
    return ClientTls(
        root_certificates=read_ca(ca) if ca else None,
        private_key=private_key,
        certificate_chain=read_file(cert, "tls_client_cert") if cert else None,
    )


def write_private_file(path: Path, data: bytes, *, replace: bool) -> None:
    """Write `data` to `path` atomically with mode 0600 (temp file, fsync, rename).

    With ``replace=False`` the rename is a hard link, which fails if `path` exists,
    so two racing creators cannot overwrite each other's key.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:  # mkstemp creates it 0600 whatever the umask
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise errors.AlreadyExists(f"{path} already exists") from None
    finally:
        with suppress(FileNotFoundError):
            os.unlink(tmp)
    fsync_directory(path.parent)  # make the rename itself durable


def fsync_directory(directory: Path) -> None:
    """Make a rename or link inside `directory` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
