"""A real control plane on port 0 for tests: init a home, build, serve, tear down.

A home made by init serves TLS, so every client here trusts the home's CA: `cp.client()`
and `cp.channel()` directly, and the device test doubles through `cp.address`, which
carries the CA along (see Address).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from contract.pinned_keys import PinnedKeyRing
from contract.transport import ClientTls, channel_credentials
from control_plane.api.client import AdminClient
from control_plane.api.transport import client_tls
from control_plane.app import App, build_app
from control_plane.home import init_home, read_token
from control_plane.pins import read_pins
from control_plane.registry.registry import Registry
from control_plane.serve import ServerHandle, create_server
from control_plane.settings import CONFIG_FILE, Config, load_config


class Address(str):
    """A server's HOST:PORT that also carries what a client must trust to reach it.

    A str, so tests hand `cp.address` on wherever an address goes; the test doubles that
    open their own channels read `.tls` from it (`tls_of`).
    """

    tls: ClientTls | None

    def __new__(cls, value: str, tls: ClientTls | None = None) -> Address:
        address = super().__new__(cls, value)
        address.tls = tls
        return address


def tls_of(address: str) -> ClientTls | None:
    """Return what a client of `address` trusts (None: a plain string, plaintext)."""
    return getattr(address, "tls", None)


def channel_to(address: str) -> grpc.Channel:
    """Open a blocking channel to `address`, trusting what it carries (see `Address`)."""
    credentials = channel_credentials(address, tls_of(address))
    if credentials is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, credentials)


def home_tls(home: Path) -> ClientTls:
    """Return what a client of the server serving `home` trusts (the home's CA)."""
    return client_tls(load_config(home, environ={}))


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
    def pins(self) -> PinnedKeyRing:
        """The signing keys `skiff init` pinned in this home."""
        return read_pins(self.config.home)

    @property
    def tls(self) -> ClientTls:
        return client_tls(self.config)

    @property
    def address(self) -> Address:
        return Address(f"127.0.0.1:{self.port}", self.tls)

    def client(self, token: str | None = None) -> AdminClient:
        return AdminClient(self.address, self.token if token is None else token, self.tls)

    def channel(self) -> grpc.Channel:
        """Open a blocking channel to the server, for calls the admin client does not make."""
        return channel_to(self.address)

    def stop(self) -> None:
        self.server.stop(grace=None)
        self.app.store.close()


@functools.cache
def _sqlite_at_head() -> Path:
    """An empty SQLite database migrated to head, once a process (removed at exit)."""
    from control_plane.store.sql_store import SqlStore

    folder = Path(tempfile.mkdtemp(prefix="skiff-schema-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    path = folder / "skiff.db"
    SqlStore(f"sqlite:///{path}").close()
    return path


def start_control_plane(home: Path, **settings) -> ControlPlane:
    """Serve `home` on a free loopback port, initialising it first unless it already is.

    A new home's SQLite database starts as a copy of one already migrated to head: init
    then finds the schema current (Alembic replaying every revision costs ~0.25 s, for
    hundreds of control planes a run). The migrations themselves are tested from nothing
    (tests/control_plane/store/test_store_conformance.py) and by `skiff init`.
    """
    overrides = {"grpc": "127.0.0.1:0", **settings}
    if not (home / CONFIG_FILE).exists():
        config = load_config(home, overrides, environ={})
        database = home / "skiff.db"
        if config.db == f"sqlite:///{database}" and not database.exists():
            home.mkdir(parents=True, exist_ok=True, mode=0o700)
            shutil.copyfile(_sqlite_at_head(), database)
        init_home(config)
    # Read again: init chose the TLS certificate, so this server speaks TLS like a real one.
    config = load_config(home, overrides, environ={})
    app = build_app(config)
    server, port = create_server(config, app, "127.0.0.1:0")
    server.start()
    return ControlPlane(config, app, server, port, read_token(config.home))


def copy_home(source: Path, target: Path) -> None:
    """Copy an initialised home; its config file names its own files by absolute path."""
    shutil.copytree(source, target)
    config = target / CONFIG_FILE
    config.write_text(config.read_text().replace(str(source), str(target)))


def stop_server(proc: subprocess.Popen, log: Path | None = None) -> int:
    """SIGTERM a spawned server and return its exit status; a hung one fails with its log.

    The server exits 1 with every thread's stack in its log once its stop runs past its
    own limit (serve.STOP_GRACE_S + STOP_LIMIT_S), so the wait here only covers a loaded
    machine being slow to run it.
    """
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        text = log.read_text() if log is not None else "(no log kept)"
        raise AssertionError(f"the server ignored SIGTERM for 60 s; its log:\n{text}") from None


def spawn_server(
    home: Path, *args: str, stderr=subprocess.DEVNULL, prefix: Sequence[str] = ()
) -> tuple[subprocess.Popen, Address]:
    """Run `skiff server` for `home` on a free loopback port; returns it and its address.

    `args` go after the command; `prefix` runs it through a wrapper (such as setpriv)
    that execs the server itself.
    """
    proc = subprocess.Popen(
        [
            *prefix,
            sys.executable,
            "-m",
            "control_plane.cli",
            "server",
            "--home",
            str(home),
            "--grpc",
            "127.0.0.1:0",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
    )
    line = proc.stdout.readline()
    assert "listening on" in line, line
    return proc, Address(line.split("listening on ")[1].split()[0], home_tls(home))


def spooling(pid: int | str = "self") -> int:
    """Return how many uploads process `pid`'s servers are spooling (a memfd each)."""
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            count += "memfd:skiff-model" in os.readlink(fd)
    return count
