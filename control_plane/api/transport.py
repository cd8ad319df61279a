"""TLS settings turned into gRPC credentials, for the server, the CLI and `skiff init`.

The server speaks TLS whenever a certificate is configured (a home made by `skiff init`
has one) and refuses to listen in plaintext on anything but loopback: the bearer tokens
and `PullModel`'s decrypted models must not cross a network in the clear. Clients follow
contract.transport's rule, with the CA from the settings (`tls_ca`, `--ca`,
SKIFF_CA).
"""

from __future__ import annotations

import errno
import socket
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

import grpc

from contract import errors
from contract.key_files import client_tls_files, read_file, read_private_file
from contract.transport import ClientTls, host_of, is_loopback
from control_plane.crypto import tls as certs
from control_plane.settings import Config


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
        root_certificates=read_file(config.tls_client_ca, "tls_client_ca"),
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


def check_listen(address: str, *, reuse_port: bool = False) -> None:
    """Refuse, in one line, an address this process cannot listen on (before anything opens).

    A trial bind with the socket options gRPC's own will have: SO_REUSEADDR (connections
    of a previous server in TIME_WAIT are no conflict) and, for replicas, SO_REUSEPORT.
    """
    problem = _bind_problem(address, reuse_port)
    if problem is not None:
        raise problem


def listen_failure(address: str, *, reuse_port: bool = False) -> errors.SkiffError:
    """Return why gRPC could not bind `address` (gRPC only says that it could not)."""
    return _bind_problem(address, reuse_port) or errors.Unavailable(f"cannot listen on {address}")


def _bind_problem(address: str, reuse_port: bool) -> errors.SkiffError | None:
    if address.startswith("unix:"):
        return None
    host, _, port = address.removeprefix("dns:///").rpartition(":")
    if not (port.isascii() and port.isdecimal()) or int(port) > 65535:
        return errors.InvalidArgument(
            f"cannot listen on {address}: give HOST:PORT (--grpc), e.g. 127.0.0.1:7443"
        )
    if int(port) == 0:  # the kernel picks a free one
        return None
    host = host.removeprefix("[").removesuffix("]")
    try:
        found = socket.getaddrinfo(
            host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        return errors.InvalidArgument(f"cannot listen on {address}: {host}: {exc.strerror}")
    for family, kind, proto, _, sockaddr in found:
        try:
            probe = socket.socket(family, kind, proto)
        except OSError:  # a family this kernel lacks (IPv6 off): gRPC skips it too
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                return _bind_refusal(address, int(port), exc)
    return None


def _bind_refusal(address: str, port: int, exc: OSError) -> errors.SkiffError:
    where = f"cannot listen on {address}"
    if exc.errno == errno.EADDRINUSE:
        return errors.FailedPrecondition(
            f"{where}: address in use (by another skiff server, or another program): "
            "stop it, or choose another --grpc address"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return errors.InvalidArgument(f"{where}: no network interface of this machine has it")
    if exc.errno == errno.EACCES and port < 1024:
        return errors.PermissionDenied(f"{where}: a port below 1024 needs privileges")
    return errors.Unavailable(f"{where}: {exc.strerror}")


def client_tls(config: Config) -> ClientTls:
    """Return what the CLI trusts (tls_ca) and presents (tls_client_cert/key) to a server."""
    return client_tls_files(config.tls_ca, config.tls_client_cert, config.tls_client_key)


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
