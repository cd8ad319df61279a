"""How a client secures its channel to a control plane: shared by devices and the CLI.

The rule, in one place: with a CA given, TLS verified against that CA; without one,
plaintext only to a loopback address (the local demo, tests, benchmarks) and TLS
verified against the system's roots anywhere else. A bearer credential therefore never
crosses a network in the clear, whatever the caller forgot to configure.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import grpc


@dataclass(frozen=True)
class ClientTls:
    """What a client trusts (PEM CA certificates) and, for mutual TLS, what it presents."""

    root_certificates: bytes | None = None
    private_key: bytes | None = field(default=None, repr=False)
    certificate_chain: bytes | None = None


def host_of(address: str) -> str:
    """Return the host of HOST:PORT, [V6]:PORT or HOST (gRPC's dns:/// prefix allowed)."""
    address = address.removeprefix("dns:///")
    if address.startswith("["):
        return address[1:].split("]", 1)[0]
    if address.count(":") > 1:  # a bare IPv6 literal without a port
        return address
    return address.rsplit(":", 1)[0] if ":" in address else address


def is_loopback(address: str) -> bool:
    """Return whether `address` can only reach this machine (localhost, 127/8, ::1)."""
    if address.startswith("unix:"):
        return True
    host = host_of(address)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # another host name: it may resolve anywhere


def channel_credentials(address: str, tls: ClientTls | None) -> grpc.ChannelCredentials | None:
    """Return the credentials for dialing `address`, or None for a plaintext channel."""
    tls = tls or ClientTls()
    if tls == ClientTls() and is_loopback(address):
        return None
    return grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )
