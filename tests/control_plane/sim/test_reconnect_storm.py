"""10,000 watching devices reconnect at once after a server restart: no device fails.

A device may see a call time out while 10,000 of them sync at once on a shared 2-core
machine; it retries, as an agent does. What must never happen is a device refused, an
artifact that does not verify, or a device left behind.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import secrets
import shutil
import signal
import subprocess
import sys
import time

import pytest
from sqlalchemy import create_engine, insert

from contract.key_wrap import DeviceKeyPair
from control_plane.api.client import AdminClient
from control_plane.crypto import ManifestSigner
from control_plane.home import read_token
from control_plane.settings import CONFIG_FILE, load_config
from control_plane.sim import FleetSimulator, SimOptions
from control_plane.sim.profile import load_profile
from control_plane.sim.state import Identity
from control_plane.store import orm
from protos import fleet_pb2
from tests.control_plane.helpers import home_tls
from tests.control_plane.sim.conftest import MODEL

DEVICES = 10_000
# Run alone (make test runs `serial` tests after the parallel part): it loads the machine.
pytestmark = [pytest.mark.slow, pytest.mark.serial]
# Call failures another attempt fixes; every other kind fails the test. An Ack that fails
# so is counted apart (the device installs anyway; its next answer is acknowledged).
TRANSIENT = {"deadline_exceeded", "unavailable", "cancelled", "resource_exhausted"}
TRANSIENT |= {f"ack_{kind}" for kind in TRANSIENT}


def _bulk_enroll(home, n: int) -> list[Identity]:
    """Insert `n` devices straight into the database, as n Enrolls would (fsyncs aside)."""
    config = load_config(home, environ={})
    signing = ManifestSigner.load(config.signing_key).public_key_pem()
    profile = load_profile()
    # One key pair serves every device here: only unwrapping (per device) needs it.
    keys = DeviceKeyPair.generate()
    private, public = keys.private_keyset(), keys.public_keyset()
    identities, rows = [], []
    now = dt.datetime.now(dt.UTC)
    for i in range(n):
        device_id, credential = f"dev_{i:016x}", "skd_" + secrets.token_urlsafe(32)
        attrs = profile.attributes(3, i)
        identities.append(Identity(device_id, credential, private, attrs, (signing,), 300))
        rows.append(
            {
                "id": device_id,
                "credential_sha256": hashlib.sha256(credential.encode()).hexdigest(),
                "public_keyset": public,
                "attributes": attrs,
                "stamped_attributes": {},
                "enrollment_token_id": "bulk",
                "enrolled_at": now,
                "revoked_reason": "",
            }
        )
    engine = create_engine(config.db)
    with engine.begin() as conn:
        conn.execute(insert(orm.DeviceRow), rows)
    engine.dispose()
    return identities


def _serve(home, address: str) -> subprocess.Popen:
    for _ in range(50):  # the old listener may take a moment to let go of the port
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "control_plane.cli",
                "server",
                "--home",
                str(home),
                "--grpc",
                address,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        if "listening on" in proc.stdout.readline():
            return proc
        proc.wait(timeout=10)
        time.sleep(0.2)
    raise AssertionError(f"cannot listen on {address}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.2)


def test_ten_thousand_devices_reconnect_after_a_restart(template_home, tmp_path):
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 65536), hard))
    home = tmp_path / "home"
    shutil.copytree(template_home, home)
    config_file = home / CONFIG_FILE
    config_file.write_text(config_file.read_text().replace(str(template_home), str(home)))
    identities = _bulk_enroll(home, DEVICES)
    address = f"127.0.0.1:{_free_port()}"
    holder = {"proc": _serve(home, address)}
    options = SimOptions(devices_per_channel=500, sync_jitter_s=2.0, concurrency=256)

    async def scenario() -> None:
        async with FleetSimulator([address], options=options, tls=home_tls(home)) as sim:
            sim.adopt(identities)
            assert await sim.sync_all() == 0
            sim.watch_all()
            await _until(lambda: sim.stats().watching == DEVICES, 60, "every stream")
            before = sim.stats()
            holder["proc"].send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(holder["proc"].wait, 60) == 0
            holder["proc"] = await asyncio.to_thread(_serve, home, address)
            await _until(
                lambda: sim.stats().reconnects >= before.reconnects + DEVICES,
                120,
                "every device to notice the restart",
            )
            with AdminClient(address, read_token(home), home_tls(home)) as client:
                await asyncio.to_thread(
                    client.create_rollout,
                    fleet_pb2.CreateRolloutRequest(model=MODEL, version=1),
                )
            await sim.wait_synced(MODEL, 1, installed=True, timeout=180)
            after = sim.stats()
            assert after.rejected == 0 and after.converged == DEVICES
            assert set(after.failures) <= TRANSIENT, after.failures
            print(f"retried call failures: {after.failures or 'none'}")

    try:
        asyncio.run(scenario())
    finally:
        holder["proc"].send_signal(signal.SIGTERM)
        holder["proc"].wait(timeout=60)
