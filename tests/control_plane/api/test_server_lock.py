"""One `skiff server` per home and address, unless the operator asks for replicas.

gRPC turns SO_REUSEPORT on by default, so a second server on a taken port used to start
and print "listening" while the first kept serving; a second server on a home used to
run beside the first on the same SQLite database. Each is now refused in one line.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Iterator

import pytest

from contract import errors
from control_plane.home import init_home
from control_plane.serve import start_server
from control_plane.settings import load_config
from tests.control_plane.cli.test_cli import skiff
from tests.control_plane.helpers import spawn_server

EXIT_INVALID, EXIT_CONFLICT = 3, 7


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    home = tmp_path_factory.mktemp("lock") / "home"
    init_home(load_config(home, environ={}))
    return home


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("skiff: error: ") and "Traceback" not in stderr, stderr
    return lines[0]


def _stop(proc) -> None:  # SIGTERM: the way an operator stops it
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_a_second_server_on_a_home_is_refused_and_the_lock_goes_with_the_first(home):
    first, address = spawn_server(home)
    try:
        second = skiff("server", "--home", str(home), "--grpc", "127.0.0.1:0", check=False)
        assert second.returncode == EXIT_CONFLICT, second.stderr
        line = _one_line(second.stderr)
        assert f"{home} is served by another skiff server (pid {first.pid}, {address})" in line
        assert "--replica" in line
        assert "listening" not in second.stdout
    finally:
        first.kill()  # SIGKILL: no cleanup at all; the kernel drops the lock with it
        first.wait(timeout=30)
    again, _ = start_server(config=load_config(home, environ={}), address="127.0.0.1:0")
    again.stop(grace=None)
    again.app.store.close()


@pytest.fixture
def taken_port() -> Iterator[int]:
    """A port another program listens on, with SO_REUSEPORT as gRPC's servers have."""
    with socket.socket() as other:
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_a_port_another_program_listens_on_is_refused(home, taken_port):
    # Before: gRPC set SO_REUSEPORT too, so the kernel let this server share the port.
    result = skiff("server", "--home", str(home), "--grpc", f"127.0.0.1:{taken_port}", check=False)
    assert result.returncode == EXIT_CONFLICT, result.stderr
    line = _one_line(result.stderr)
    assert f"cannot listen on 127.0.0.1:{taken_port}: address in use" in line


def test_in_process_servers_take_the_lock_and_give_it_back(home, taken_port):
    config = load_config(home, environ={})
    with pytest.raises(errors.FailedPrecondition, match="address in use"):
        start_server(config=config, address=f"127.0.0.1:{taken_port}")
    # The refusal above let go of the home: this one takes it.
    server, _ = start_server(config=config, address="127.0.0.1:0")
    try:
        with pytest.raises(errors.FailedPrecondition, match="served by another skiff server"):
            start_server(config=config, address="127.0.0.1:0")
    finally:
        server.stop(grace=None)
        server.app.store.close()
    server, _ = start_server(config=config, address="127.0.0.1:0")  # released by stop
    server.stop(grace=None)
    server.app.store.close()


def test_replica_on_sqlite_is_refused(home):
    result = skiff("server", "--home", str(home), "--replica", check=False)
    assert result.returncode == EXIT_INVALID, result.stderr
    assert "--replica needs a PostgreSQL database" in _one_line(result.stderr)


@pytest.mark.postgres
def test_replicas_on_postgresql_share_a_home_and_a_port(tmp_path, pg_url):
    home = tmp_path / "home"
    init_home(load_config(home, {"db": pg_url}, environ={}))
    a, address = spawn_server(home, "--replica")
    try:
        b, same = spawn_server(home, "--replica", "--grpc", address)  # the last --grpc wins
        try:
            assert same == address
            plain = skiff("server", "--home", str(home), "--grpc", "127.0.0.1:0", check=False)
            assert plain.returncode == EXIT_CONFLICT, plain.stderr
            line = _one_line(plain.stderr)
            assert f"{home} is served by skiff servers started with --replica" in line
        finally:
            _stop(b)
    finally:
        _stop(a)
