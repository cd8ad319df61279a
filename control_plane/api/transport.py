"""TLS settings turned into gRPC credentials, for the server, the CLI and `skiff init`.

The server speaks TLS whenever a certificate is configured (a home made by `skiff init`
has one) and refuses to listen in plaintext on anything but loopback: the bearer tokens
and `PullModel`'s decrypted models must not cross a network in the clear. Clients follow
device_agent.transport's rule, with the CA from the settings (`tls_ca`, `--ca`,
SKIFF_CA).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import grpc

from control_plane import errors
from control_plane.crypto import tls as certs
from control_plane.files import read_private_file
from control_plane.settings import Config
from device_agent.transport import ClientTls, host_of, is_loopback


def server_credentials(config: Config) -> grpc.ServerCredentials | None:
    """Return TLS credentials for the server's port, or None when none are configured."""
    if not config.tls_cert and not config.tls_key:
        if config.tls_client_ca:
            raise errors.InvalidArgument("tls_client_ca needs tls_cert and tls_key")
        return None
    certs.check_server_pair(config.tls_cert, config.tls_key)
    key = read_private_file(Path(config.tls_key))
    chain = Path(config.tls_cert).read_bytes()
    if not config.tls_client_ca:
        return grpc.ssl_server_credentials([(key, chain)])
    # Mutual TLS: a client without a certificate from this CA fails the handshake, before
    # any call (devices still present their bearer credential on every call).
    return grpc.ssl_server_credentials(
        [(key, chain)],
        root_certificates=_read(config.tls_client_ca, "tls_client_ca"),
        require_client_auth=True,
    )


def listen_credentials(config: Config, address: str) -> grpc.ServerCredentials | None:
    """Return the credentials to serve `address` with; None (plaintext) only on loopback."""
    credentials = server_credentials(config)
    if credentials is None and not is_loopback(address):
        raise errors.InvalidArgument(
            f"refusing to listen on {address} without TLS: tokens and models would cross "
            "the network in plaintext; set tls_cert and tls_key (skiff init makes them, "
            "--tls-san NAME adds a host name) or listen on 127.0.0.1"
        )
    return credentials


def client_tls(config: Config) -> ClientTls:
    """Return what the CLI trusts (tls_ca) and presents (tls_client_cert/key) to a server."""
    if bool(config.tls_client_cert) != bool(config.tls_client_key):
        raise errors.InvalidArgument("tls_client_cert and tls_client_key go together")
    return ClientTls(
        root_certificates=_read(config.tls_ca, "the CA") if config.tls_ca else None,
        private_key=read_private_file(Path(config.tls_client_key))
        if config.tls_client_key
        else None,
        certificate_chain=_read(config.tls_client_cert, "tls_client_cert")
        if config.tls_client_cert
        else None,
    )


def init_tls(config: Config, names: Iterable[str] = ()) -> Config:
    """Check a user's own certificate, or make the home's CA and server certificate.

    The generated certificate names loopback, the hosts of `grpc` and `server`, and
    `names` (`--tls-san`); returns `config` with the paths filled in.
    """
    names = tuple(names)
    if config.tls_cert or config.tls_key:
        if not (config.tls_cert and config.tls_key):
            raise errors.InvalidArgument("--tls-cert and --tls-key go together")
        if names:
            raise errors.InvalidArgument("--tls-san names a generated certificate's hosts")
        certs.check_server_pair(config.tls_cert, config.tls_key, config.tls_ca)
        return config
    if config.tls_ca:
        raise errors.InvalidArgument("--tls-ca names the CA of your own --tls-cert")
    for name in names:
        certs.general_name(name)  # refuse a malformed name before any file is written
    hosts = [host_of(a) for a in (config.grpc, config.server) if a]
    paths = certs.create_home_tls(config.home, [*hosts, *names])
    return replace(
        config,
        tls_cert=str(paths.server_cert),
        tls_key=str(paths.server_key),
        tls_ca=str(paths.ca_cert),
    )


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read {what} {path}: {exc.strerror}") from None
