"""Two control-plane processes on one PostgreSQL: a change made through one reaches
devices watching the other (LISTEN/NOTIFY), and revocation closes streams everywhere."""

from __future__ import annotations

import signal
import time

import pytest

from control_plane.api.client import AdminClient
from protos import fleet_pb2
from tests.control_plane.api.device_helpers import Device, Watching
from tests.control_plane.cli.test_cli import skiff
from tests.control_plane.helpers import home_tls, spawn_server

pytestmark = pytest.mark.postgres


@pytest.fixture
def replicas(tmp_path, pg_url):
    home = tmp_path / "home"
    skiff("init", "--home", str(home), "--db", pg_url, "--json")
    procs = [spawn_server(home, "--replica"), spawn_server(home, "--replica")]
    token = (home / "admin.token").read_text().strip()
    tls = home_tls(home)
    yield [AdminClient(address, token, tls) for _, address in procs], [a for _, a in procs]
    for proc, _ in procs:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_change_on_one_replica_reaches_watchers_on_the_other(replicas, onnx_path):
    (a, b), (address_a, address_b) = replicas
    a.push(onnx_path, name="det")
    token = b.create_enrollment_token().token
    on_b = Device.enroll(address_b, token, {"platform": "android"})
    bystander = Device.enroll(address_b, token, {"platform": "ios"})
    on_b.sync(), bystander.sync()
    with Watching(on_b) as w, Watching(bystander) as quiet:
        time.sleep(0.5)
        started = time.monotonic()
        r = a.create_rollout(
            fleet_pb2.CreateRolloutRequest(model="det", version=1, selector="platform=android")
        )
        assert w.wait(1, timeout=5), "the watcher on replica B never heard of the rollout"
        elapsed = time.monotonic() - started
        assert not quiet.wait(1, timeout=0.5)
        # Replica A sees B's stream as online (B marks it in the database).
        deadline = time.monotonic() + 5
        while not a.get_device(on_b.id).online and time.monotonic() < deadline:
            time.sleep(0.2)
        assert a.get_device(on_b.id).online
    assert elapsed < 2.0
    verified = on_b.sync()
    assert verified.models["det"].rollout == r.id
    on_b.install(verified, "det")

    # Revoked through A: B refuses the device at once, open stream included.
    with Watching(on_b) as w:
        time.sleep(0.5)
        a.revoke_device(on_b.id)
        deadline = time.monotonic() + 5
        while w.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert w.error is not None and "revoked" in str(w.error)
    for client in (a, b):
        client.close()
