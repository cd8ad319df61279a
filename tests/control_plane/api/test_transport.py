"""TLS on the gRPC port: what crosses the wire, who is refused, and with which words."""

from __future__ import annotations

import asyncio
import socket
import threading
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from contract import errors
from contract.device_client import DeviceCallError, DeviceConnection, open_channel
from contract.key_wrap import DeviceKeyPair
from contract.transport import ClientTls, channel_credentials, is_loopback
from control_plane.api.client import AdminClient
from control_plane.api.transport import client_tls
from control_plane.app import build_app
from control_plane.crypto import tls as certs
from control_plane.demo import sample_models
from control_plane.home import init_home, read_token
from control_plane.serve import create_server
from control_plane.settings import Config, load_config
from protos import device_pb2
from tests.control_plane.helpers import ControlPlane


def _home(tmp_path: Path) -> Config:
    """Init a home (with its TLS files) and return its settings, listening on port 0."""
    init_home(load_config(tmp_path / "home", {"grpc": "127.0.0.1:0"}, environ={}))
    return load_config(tmp_path / "home", {"grpc": "127.0.0.1:0"}, environ={})


def _serve(config: Config) -> ControlPlane:
    app = build_app(config)
    try:
        server, port = create_server(config, app, config.grpc)
    except Exception:
        app.store.close()
        raise
    server.start()
    return ControlPlane(config, app, server, port, read_token(config.home))


def _plaintext(config: Config) -> Config:
    return replace(config, tls_cert="", tls_key="", tls_ca="")


class Tap:
    """A TCP proxy on loopback that records every byte it forwards, both ways."""

    def __init__(self, target_port: int) -> None:
        self.seen = bytearray()
        self._lock = threading.Lock()
        self._target = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            upstream = socket.create_connection(("127.0.0.1", self._target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                with self._lock:
                    self.seen += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self._listener.close()


def _windows(data: bytes, size: int = 48) -> list[bytes]:
    """A few stretches of `data`: any one of them on the wire means the data was there."""
    return [data[i : i + size] for i in range(0, len(data) - size, max(1, len(data) // 8))]


@pytest.mark.parametrize("tls", [True, False], ids=["tls", "plaintext"])
def test_token_and_models_cross_the_wire_only_as_tls_records(tmp_path, tls):
    config = _home(tmp_path)
    cp = _serve(config if tls else _plaintext(config))
    tap = Tap(cp.port)
    model = tmp_path / "det.onnx"
    model.write_bytes(sample_models.tiny_mlp_onnx(seed=3))
    try:
        with AdminClient(f"127.0.0.1:{tap.port}", cp.token, cp.tls) as client:
            client.push(model, name="det")
            client.pull("det", 1, tmp_path / "det.mnn", pins=cp.pins)
    finally:
        tap.close()
        cp.stop()
    pulled = (tmp_path / "det.mnn").read_bytes()
    secrets_seen = [
        cp.token.encode() in tap.seen,
        any(w in tap.seen for w in _windows(model.read_bytes())),
        any(w in tap.seen for w in _windows(pulled)),
    ]
    # The plaintext run shows the check can see them; with TLS none of them is there.
    assert secrets_seen == [not tls] * 3


def test_server_refuses_a_plaintext_bind_off_loopback(tmp_path):
    config = _plaintext(_home(tmp_path))
    for address in ("0.0.0.0:0", "[::]:0", "192.168.1.20:0", "skiff.example:0", ":0"):
        with pytest.raises(errors.InvalidArgument, match="without TLS"):
            _serve(replace(config, grpc=address))
    for address in ("127.0.0.1:0", "localhost:0", "[::1]:0"):
        _serve(replace(config, grpc=address)).stop()


def test_a_home_made_by_init_serves_tls_on_any_address(tmp_path):
    cp = _serve(replace(_home(tmp_path), grpc="0.0.0.0:0"))
    try:
        assert cp.server.tls
        with cp.client() as client:
            assert client.list_models() == []
    finally:
        cp.stop()


def test_clients_dial_plaintext_only_to_loopback_without_a_ca():
    assert channel_credentials("127.0.0.1:7443", None) is None
    assert channel_credentials("localhost:7443", ClientTls()) is None
    for address in ("10.0.0.5:7443", "skiff.example:7443", "[2001:db8::1]:7443"):
        assert channel_credentials(address, None) is not None, address
    assert channel_credentials("127.0.0.1:7443", ClientTls(b"ca")) is not None
    assert [is_loopback(a) for a in ("127.0.0.2:1", "[::1]:1", "0.0.0.0:1", "myhost:1")] == [
        True,
        True,
        False,
        False,
    ]


@pytest.fixture
def tls_plane(tmp_path):
    cp = _serve(_home(tmp_path))
    yield cp
    cp.stop()


def _code_and_message(call) -> tuple[type, str]:
    with pytest.raises(errors.SkiffError) as caught:
        call()
    return type(caught.value), str(caught.value)


def test_a_client_with_another_ca_is_refused_in_one_line(tls_plane, tmp_path):
    other = _home(tmp_path / "other")
    with AdminClient(tls_plane.address, tls_plane.token, client_tls(other)) as client:
        kind, message = _code_and_message(client.list_models)
    assert kind is errors.Unavailable
    assert "not signed by the CA this client trusts" in message and "\n" not in message


def test_a_certificate_for_another_name_is_refused(tmp_path):
    config = _home(tmp_path)
    paths = certs.HomeTls.of(config.home)
    key, cert = certs.issue_certificate(
        *certs.load_ca(paths), common_name="elsewhere", names=["skiff.example"]
    )
    paths.server_key.write_bytes(key)
    paths.server_cert.write_bytes(cert)
    cp = _serve(config)
    try:
        with cp.client() as client:
            kind, message = _code_and_message(client.list_models)
    finally:
        cp.stop()
    assert kind is errors.Unavailable
    assert "does not name the host dialed" in message


def test_a_plaintext_client_of_a_tls_server_is_told_to_give_the_ca(tls_plane):
    with AdminClient(tls_plane.address, tls_plane.token) as client:
        kind, message = _code_and_message(client.list_models)
    assert kind is errors.Unavailable and "give its CA" in message


def _enroll(address: str, tls: ClientTls, token: str) -> str:
    async def main() -> str:
        channel = open_channel(address, tls)
        try:
            keyset = DeviceKeyPair.generate().public_keyset()
            reply = await DeviceConnection(channel).enroll(
                token, device_pb2.DeviceAttributes(), keyset
            )
            return reply.device_id
        finally:
            await channel.close()

    return asyncio.run(main())


def test_mutual_tls_refuses_a_device_without_a_client_certificate(tmp_path):
    config = _home(tmp_path)
    paths = certs.HomeTls.of(config.home)
    config = replace(config, tls_client_ca=str(paths.ca_cert))
    key, cert = certs.issue_certificate(*certs.load_ca(paths), common_name="dev", client=True)
    cp = _serve(config)
    try:
        (tmp_path / "op.key").write_bytes(key)
        (tmp_path / "op.key").chmod(0o600)
        (tmp_path / "op.pem").write_bytes(cert)
        operator = replace(
            config,
            tls_client_key=str(tmp_path / "op.key"),
            tls_client_cert=str(tmp_path / "op.pem"),
        )
        with AdminClient(cp.address, cp.token, client_tls(operator)) as client:
            token = client.create_enrollment_token().token
        with AdminClient(cp.address, cp.token, cp.tls) as client:  # no certificate
            assert _code_and_message(client.list_models)[0] is errors.Unavailable
        with pytest.raises(DeviceCallError) as refused:
            _enroll(cp.address, cp.tls, token)
        assert refused.value.code == grpc.StatusCode.UNAVAILABLE
        device = replace(cp.tls, private_key=key, certificate_chain=cert)
        assert _enroll(cp.address, device, token).startswith("dev_")
    finally:
        cp.stop()
