"""A connection that fails says why in one line, the same from the CLI and the agent.

Before, the agent printed gRPC's own words ("failed to connect to all addresses; last
error: UNAVAILABLE: ipv4:...: Socket closed", "missing selected ALPN property",
"Misformatted domain name"), and the CLI did for all but a missing CA.
"""

from __future__ import annotations

import asyncio
import http.server
import threading
from dataclasses import replace

import pytest

from contract import errors
from contract.device_client import DeviceCallError, DeviceConnection, open_channel
from contract.transport import connect_hint, retry_helps
from control_plane.api.client import AdminClient
from control_plane.api.transport import client_tls
from protos import device_pb2
from tests.control_plane.cli.test_cli import skiff
from tests.control_plane.helpers import start_control_plane

EXIT_INVALID, EXIT_UNAVAILABLE = 3, 6


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """A TLS server on port 0 with its dashboard (HTTPS) on another port 0."""
    root = tmp_path_factory.mktemp("hints")
    cp = start_control_plane(root / "home", http="127.0.0.1:0")
    bad = root / "not-a-ca.pem"
    bad.write_text("this is a token, not a certificate\n")
    yield {
        "cp": cp,
        "grpc": f"127.0.0.1:{cp.port}",
        "dashboard": f"127.0.0.1:{cp.server.dashboard.port}",
        "ca": cp.config.tls_ca,
        "bad_ca": str(bad),
        "root": root,
    }
    cp.stop()


def _cli(plane, server: str, ca: str | None):
    # A client with no home of its own: the token and CA come from the environment only.
    env = {
        "SKIFF_HOME": str(plane["root"] / "client"),
        "SKIFF_SERVER": server,
        "SKIFF_TOKEN": plane["cp"].token,
        "SKIFF_CA": ca or "",
    }
    return skiff("model", "ls", env=env, check=False)


def _agent(plane, server: str, ca: str | None, tmp_path):
    env = {"SKIFF_CA": "", "SKIFF_AGENT_SERVER": "", "SKIFF_ENROLL_TOKEN": ""}
    args = ["agent", "run", "--once", "--server", server, "--state", str(tmp_path / "agent")]
    args += ["--enroll-token", "skfe_whatever", *(["--ca", ca] if ca else [])]
    return skiff(*args, env=env, check=False)


CASES = {
    # name: (which address, which CA, exit code, words of the hint)
    "no CA for a TLS server": ("grpc", None, EXIT_UNAVAILABLE, "it speaks TLS; give its CA"),
    "a CA file that is not PEM": (
        "grpc",
        "bad_ca",
        EXIT_INVALID,
        "is not a PEM certificate: it has no -----BEGIN CERTIFICATE----- block",
    ),
    "the dashboard's port": (
        "dashboard",
        "ca",
        EXIT_UNAVAILABLE,
        "answers HTTP, not gRPC (the dashboard's port",
    ),
    "a URL": ("url", "ca", EXIT_INVALID, "is a URL; the control plane's address is HOST:PORT"),
    "an unknown host": (
        "unknown",
        "ca",
        EXIT_UNAVAILABLE,
        "unknown host nonexistent.invalid: the name does not resolve",
    ),
}


def _address(plane, which: str) -> str:
    return {
        "grpc": plane["grpc"],
        "dashboard": plane["dashboard"],
        "url": f"http://{plane['grpc']}",
        "unknown": "nonexistent.invalid:7443",
    }[which]


@pytest.mark.parametrize("who", ["cli", "agent"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_failed_connection_says_why_in_one_line(plane, case, who, tmp_path):
    which, ca, code, words = CASES[case]
    server, ca_path = _address(plane, which), plane[ca] if ca else None
    if who == "cli":
        result = _cli(plane, server, ca_path)
    else:
        result = _agent(plane, server, ca_path, tmp_path)
    assert result.returncode == code, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr  # no traceback, no gRPC or agent log lines
    assert lines[0].startswith("skiff: error: ") and words in lines[0], lines[0]
    assert "failed to connect to all addresses" not in lines[0]
    assert result.stdout == ""


@pytest.fixture
def plain_http():
    """An HTTP/1.1 server without TLS: what gRPC meets at a plaintext dashboard's port."""
    server = http.server.HTTPServer(("127.0.0.1", 0), _Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_port}"
    server.shutdown()
    server.server_close()


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:  # gRPC's preface is a bad request: not news
        pass


def test_a_plaintext_http_port_gets_the_same_hint_in_the_client_and_the_agent(plain_http):
    with AdminClient(plain_http, "skf_token") as client, pytest.raises(errors.Unavailable) as cli:
        client.list_models()

    async def enroll() -> DeviceCallError:
        channel = open_channel(plain_http)
        conn = DeviceConnection(channel, address=plain_http, plaintext=True)
        try:
            with pytest.raises(DeviceCallError) as caught:
                await conn.enroll("skfe_token", device_pb2.DeviceAttributes(), b"")
            return caught.value
        finally:
            await channel.close()

    agent = asyncio.run(enroll())
    assert str(cli.value) == agent.message
    assert agent.message == (
        f"control plane unreachable: {plain_http} answers HTTP, not gRPC (the dashboard's "
        "port, --http?): dial the server's gRPC port (--grpc)"
    )


# -- what is not a mistake of the command line is not called one ------------------------


def test_a_server_that_goes_away_mid_call_is_not_blamed_on_tls():
    # gRPC's words when a plaintext server is killed during a call (the connection was
    # made): not the plaintext-to-TLS mismatch, which fails to connect at all.
    mid_call = "Stream removed (Socket closed)"
    assert connect_hint("127.0.0.1:7443", mid_call, plaintext=True) is None
    mismatch = (
        "failed to connect to all addresses; last error: UNAVAILABLE: "
        "ipv4:127.0.0.1:7443: Socket closed"
    )
    assert "give its CA" in connect_hint("127.0.0.1:7443", mismatch, plaintext=True)


def test_a_resolver_that_does_not_answer_is_retried_and_not_called_a_typo():
    down = (
        "errors resolving cp.example.com:7443: [field:hostname lookup error:address "
        "lookup failed for cp.example.com:7443: Could not contact DNS servers]"
    )
    hint = connect_hint("cp.example.com:7443", down, plaintext=False)
    assert hint.startswith("DNS did not answer for cp.example.com") and "typo" not in hint
    assert retry_helps(down)
    missing = down.replace("Could not contact DNS servers", "Domain name not found")
    assert "typo" in connect_hint("cp.example.com:7443", missing, plaintext=False)
    assert not retry_helps(missing)


def test_a_client_key_that_is_not_the_certificates_is_refused_naming_it(plane, tmp_path):
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    other = tmp_path / "other.key"
    other.write_bytes(
        ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    other.chmod(0o600)
    config = replace(plane["cp"].config, tls_client_cert=plane["ca"], tls_client_key=str(other))
    with pytest.raises(errors.InvalidArgument, match="does not match"):
        client_tls(config)
