"""A real control plane on port 0 for tests: init a home, build, serve, tear down."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from control_plane.api.client import AdminClient
from control_plane.api.server import App, ServerHandle, build_app, create_server
from control_plane.home import init_home, read_token
from control_plane.pins import read_pins
from control_plane.registry.registry import Registry
from control_plane.settings import Config, load_config
from device_agent.signing_keys import KeyRing


@dataclass
class ControlPlane:
    """A running server with handles on its parts, for assertions."""

    config: Config
    app: App
    server: ServerHandle
    port: int
    token: str

    @property
    def registry(self) -> Registry:
        return self.app.registry

    @property
    def pins(self) -> KeyRing:
        """The signing keys `skiff init` pinned in this home."""
        return read_pins(self.config.home)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, token: str | None = None) -> AdminClient:
        return AdminClient(self.address, self.token if token is None else token)

    def stop(self) -> None:
        self.server.stop(grace=None)
        self.app.store.close()


def start_control_plane(home: Path, **settings) -> ControlPlane:
    config = load_config(home, {"grpc": "127.0.0.1:0", **settings}, environ={})
    init_home(config)
    app = build_app(config)
    server, port = create_server(config, app, "127.0.0.1:0")
    server.start()
    return ControlPlane(config, app, server, port, read_token(config.home))


def spawn_server(home: Path) -> tuple[subprocess.Popen, str]:
    """Run `skiff server` for `home` on a free loopback port; returns it and its address."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "control_plane.cli",
            "server",
            "--home",
            str(home),
            "--grpc",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, line.split("listening on ")[1].split()[0]
