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


def is_plaintext(address: str, tls: ClientTls | None) -> bool:
    """Return whether a channel to `address` with `tls` goes without TLS (the rule above)."""
    return (tls or ClientTls()) == ClientTls() and is_loopback(address)


def channel_credentials(address: str, tls: ClientTls | None) -> grpc.ChannelCredentials | None:
    """Return the credentials for dialing `address`, or None for a plaintext channel."""
    if is_plaintext(address, tls):
        return None
    tls = tls or ClientTls()
    return grpc.ssl_channel_credentials(
        root_certificates=tls.root_certificates,
        private_key=tls.private_key,
        certificate_chain=tls.certificate_chain,
    )


# gRPC's own target schemes (dns:///host:port, unix:path, ...); any other "scheme://" is a
# URL someone copied from a browser or a dashboard link.
_GRPC_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock"})


def address_problem(address: str) -> str | None:
    """Return why `address` cannot be a control plane's gRPC address, or None if it can be.

    Caught before dialing: gRPC would only say "Misformatted domain name" about a URL.
    """
    scheme, sep, rest = address.partition("://")
    if sep and scheme.lower() not in _GRPC_SCHEMES:
        return (
            f"{address} is a URL; the control plane's address is HOST:PORT "
            f"(e.g. {rest.split('/', 1)[0] or '127.0.0.1:7443'}), without {scheme}://"
        )
    return None


def pem_problem(data: bytes) -> str | None:
    """Return why `data` is not PEM certificates (gRPC only fails every handshake later)."""
    from cryptography import x509  # deferred: only when a CA file is read

    try:
        x509.load_pem_x509_certificates(data)
    except ValueError:
        if data[:1] == b"\x30":  # an ASN.1 SEQUENCE: DER, the binary form
            return "not PEM but DER (binary): `openssl x509 -inform der -in FILE -out ca.pem`"
        return "not a PEM certificate: it has no -----BEGIN CERTIFICATE----- block"
    return None


# What gRPC's details for a connection that failed say (a marker in them), and what it
# means for whoever dialed. First match wins; each is one line naming what to do.
_TLS_FAILURES = (
    (
        "CERTIFICATE_VERIFY_FAILED",
        "the server's TLS certificate is not signed by the CA this client trusts "
        "(--ca, SKIFF_CA or the home's tls_ca)",
    ),
    (
        "Hostname Verification",
        "the server's TLS certificate does not name the host dialed "
        "(`skiff init --tls-san NAME` names it; or dial a name it has)",
    ),
    ("WRONG_VERSION_NUMBER", "the server does not speak TLS (dial it without --ca on loopback)"),
    (
        "Failed to create security handshaker",
        "the CA (--ca or SKIFF_CA) or the client certificate and key given are not usable "
        "PEM, or the key is not the certificate's",
    ),
)


# gRPC's words for a name lookup that failed, and (among them) for a name that has no
# address, as opposed to a resolver that did not answer (worth another try).
_DNS_MARKERS = ("errors resolving", "DNS resolution failed", "address lookup failed")
_NO_SUCH_NAME = (
    "Domain name not found",
    "Name or service not known",
    "No address associated",
    "nodename nor servname",
    "NXDOMAIN",
)

# An HTTP server where gRPC was expected: over TLS (no h2 in ALPN), or in plaintext.
_HTTP_MARKERS = ("missing selected ALPN property", "http1.x server", "Failed parsing HTTP/2")


def tls_failure(details: str) -> str | None:
    """Return what a failed TLS handshake in `details` means, or None if it is not one."""
    return next((meaning for marker, meaning in _TLS_FAILURES if marker in details), None)


def connect_hint(address: str, details: str, *, plaintext: bool) -> str | None:
    """Return the likely cause of a failed connection to `address`, as one line, or None.

    `details` are gRPC's (an UNAVAILABLE status); `plaintext` says the channel had no TLS.
    Shared by the agent and the CLI, so both say the same thing about the same mistake.
    """
    host = host_of(address)
    if problem := address_problem(address):
        return problem
    if any(marker in details for marker in _DNS_MARKERS):
        if any(marker in details for marker in _NO_SUCH_NAME):
            return f"unknown host {host}: the name does not resolve here (a typo in the address?)"
        return f"DNS did not answer for {host} (no network, or its resolver is down)"
    if any(marker in details for marker in _HTTP_MARKERS):
        return (
            f"{address} answers HTTP, not gRPC (the dashboard's port, --http?): "
            "dial the server's gRPC port (--grpc)"
        )
    if reason := tls_failure(details):
        return f"TLS handshake failed: {reason}"
    if "Connection refused" in details:
        return f"nothing listens on {address}: is the server running, and is this its --grpc port?"
    if "failed to connect" not in details:
        return None  # the call was under way: a server that went away, not a mistake
    if plaintext and ("Socket closed" in details or "Connection reset" in details):
        return (
            f"{address} closed a plaintext connection: it speaks TLS; give its CA "
            "(--ca or SKIFF_CA; `skiff init` made it as HOME/tls/ca.pem)"
        )
    return None


def unreachable(address: str, details: str, *, plaintext: bool) -> str | None:
    """Return the one line for a call to `address` that never reached the server, or None.

    None when `details` (an UNAVAILABLE status's) are about something else: a server
    that answered UNAVAILABLE itself keeps its own words.
    """
    hint = connect_hint(address, details, plaintext=plaintext)
    connecting = "failed to connect" in details or any(m in details for m in _DNS_MARKERS)
    if hint is None and not connecting:
        return None
    return "control plane unreachable: " + (hint or details.splitlines()[0])


def retry_helps(details: str) -> bool:
    """Return whether a connection that failed with `details` may work if tried again.

    A refused or reset connection may be a server restarting; a name that does not
    resolve, a URL, a certificate or the dashboard's port fails the same way every time.
    """
    hint = connect_hint("", details, plaintext=False)
    return hint is None or hint.startswith(("nothing listens", "DNS did not answer"))
