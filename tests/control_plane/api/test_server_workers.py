"""`skiff server --workers N`: N processes on one port, replicas of one home.

The kernel spreads connections over the workers (SO_REUSEPORT), so these tests look at
which process holds each connection (/proc) rather than trusting chance; a change made
through any worker must reach Watch streams on every worker, and a revocation must be
refused by every worker.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests

from contract.device_client import DeviceCallError
from control_plane.api.client import AdminClient
from control_plane.serve_workers import host_cores
from protos import fleet_pb2
from tests.control_plane.api.device_helpers import Device, Watching
from tests.control_plane.cli.test_cli import SKIFF, skiff
from tests.control_plane.helpers import spawn_server

EXIT_INVALID, EXIT_CONFLICT = 3, 7


def _children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return sorted(found)


def _established_on(port: int) -> set[str]:
    """Socket inodes of established TCP connections whose local port is `port`."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            next(f)
            for line in f:
                fields = line.split()
                if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "01":
                    inodes.add(fields[9])
    return inodes


def connections_by_worker(pids: list[int], port: int) -> collections.Counter:
    """How many established connections on `port` each process holds."""
    ours = _established_on(port)
    held: collections.Counter = collections.Counter()
    for pid in pids:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and target[8:-1] in ours:
                held[pid] += 1
    return held


@pytest.fixture
def pg_home(tmp_path, pg_url):
    home = tmp_path / "home"
    skiff("init", "--home", str(home), "--db", pg_url, "--json")
    return home


@pytest.fixture
def two_workers(pg_home, tmp_path):
    log = (tmp_path / "server.log").open("w")
    proc, address = spawn_server(pg_home, "--workers", "2", stderr=log)
    token = (pg_home / "admin.token").read_text().strip()
    yield proc, address, token
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    log.close()


@pytest.mark.postgres
def test_workers_share_the_port_and_each_serves_connections(two_workers):
    proc, address, token = two_workers
    workers = _children(proc.pid)
    assert len(workers) == 2, workers
    port = int(address.rsplit(":", 1)[1])
    clients = [AdminClient(address, token, address.tls) for _ in range(16)]
    try:
        for c in clients:  # one connection each: the kernel picks a worker per connection
            c.list_models()
        held = connections_by_worker([proc.pid, *workers], port)
        assert held[proc.pid] == 0  # the supervisor only reserves the port
        assert all(held[w] >= 1 for w in workers), held
        assert sum(held.values()) == 16
    finally:
        for c in clients:
            c.close()


@pytest.mark.postgres
def test_a_change_through_one_worker_reaches_watchers_on_every_worker(two_workers, onnx_path):
    proc, address, token = two_workers
    workers = _children(proc.pid)
    port = int(address.rsplit(":", 1)[1])
    with AdminClient(address, token, address.tls) as admin:
        admin.push(onnx_path, name="det")
        enroll = admin.create_enrollment_token().token
    devices = [Device.enroll(address, enroll, {"platform": "android"}) for _ in range(16)]
    for d in devices:
        d.sync()
    with contextlib.ExitStack() as stack:
        watching = [stack.enter_context(Watching(d)) for d in devices]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            held = connections_by_worker(workers, port)
            if sum(held.values()) >= 16:
                break
            time.sleep(0.05)
        # Sixteen streams on two workers: both hold some (a 1 in 30,000 chance otherwise).
        assert all(held[w] >= 1 for w in workers), held
        with AdminClient(address, token, address.tls) as admin:
            admin.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=1))
        late = [d.id for d, w in zip(devices, watching, strict=True) if not w.wait(1, timeout=10)]
        assert not late, f"{len(late)} watchers never heard of the rollout"
    for d in devices:
        assert d.sync().models["det"].version == 1

    # Revoked through one worker: refused by every worker, whichever a connection reaches.
    with AdminClient(address, token, address.tls) as admin:
        admin.revoke_device(devices[0].id, "lost")
    for _ in range(8):  # a new connection each time
        with pytest.raises(DeviceCallError, match="revoked"):
            devices[0].sync_raw()


@pytest.mark.postgres
def test_sigterm_stops_every_worker(two_workers):
    proc, _, _ = two_workers
    workers = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    assert not [w for w in workers if Path(f"/proc/{w}").exists()], "a worker outlived the server"


@pytest.mark.postgres
def test_a_worker_that_dies_stops_the_server(pg_home, tmp_path):
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        proc, _ = spawn_server(pg_home, "--workers", "2", stderr=log)
        try:
            first, second = _children(proc.pid)
            os.kill(first, signal.SIGKILL)
            assert proc.wait(timeout=60) == 1
        finally:
            if proc.poll() is None:
                proc.kill()
    assert not Path(f"/proc/{second}").exists() or _zombie(second)
    assert "server worker 0 exited with status -9; stopping the others" in log_path.read_text()


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.postgres
def test_the_default_is_one_worker_per_core_on_postgresql(pg_home, tmp_path):
    proc, _ = spawn_server(pg_home)
    try:
        cores = host_cores()
        assert len(_children(proc.pid)) == (cores if cores > 1 else 0)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_workers_on_sqlite_and_bad_counts_are_refused_in_one_line(tmp_path):
    home = tmp_path / "home"
    skiff("init", "--home", str(home), "--json")
    for count, words in (("2", "needs a PostgreSQL database"), ("0", "must be 1 to 256")):
        result = skiff(
            "server", "--home", str(home), "--grpc", "127.0.0.1:0", "--workers", count, check=False
        )
        assert result.returncode == EXIT_INVALID, result.stderr
        assert result.stderr.count("\n") == 1 and words in result.stderr, result.stderr
        assert "listening" not in result.stdout


@pytest.mark.postgres
def test_a_taken_port_is_refused_before_any_worker_starts(pg_home):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = skiff(
            "server",
            "--home",
            str(pg_home),
            "--grpc",
            f"127.0.0.1:{port}",
            "--workers",
            "2",
            check=False,
        )
    assert result.returncode == EXIT_CONFLICT, result.stderr
    assert "address in use" in result.stderr and "listening" not in result.stdout


@pytest.mark.postgres
def test_worker_zero_serves_the_dashboard(pg_home, tmp_path):
    proc = subprocess.Popen(
        [*SKIFF, "server", "--home", str(pg_home), "--grpc", "127.0.0.1:0"]
        + ["--http", "127.0.0.1:0", "--workers", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert "listening on" in proc.stdout.readline()
        line = proc.stdout.readline()
        assert line.startswith("dashboard and /metrics at https://127.0.0.1:"), line
        url = line.split(" at ")[1].strip()
        ca = str(pg_home / "tls" / "ca.pem")
        assert requests.get(url + "metrics", verify=ca, timeout=30).status_code in (200, 401)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


@pytest.mark.postgres
def test_workers_stop_when_their_supervisor_is_killed(pg_home, tmp_path):
    with (tmp_path / "server.log").open("w") as log:
        proc, _ = spawn_server(pg_home, "--workers", "2", stderr=log)
        workers = _children(proc.pid)
        proc.kill()  # SIGKILL: no chance to stop them
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and any(
            Path(f"/proc/{w}").exists() and not _zombie(w) for w in workers
        ):
            time.sleep(0.2)
    assert all(not Path(f"/proc/{w}").exists() or _zombie(w) for w in workers)
    assert "is gone; stopping" in (tmp_path / "server.log").read_text()
