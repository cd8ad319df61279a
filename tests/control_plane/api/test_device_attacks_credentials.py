"""Attacks on enrollment and credentials: tokens, stamped attributes, the auth cache, logs.

Shared fixtures and helpers: _attack_helpers.py.
"""

from __future__ import annotations

import base64
import concurrent.futures
import logging
import secrets
import sqlite3
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract.device_client import DeviceCallError
from contract.key_wrap import DeviceKeyPair
from contract.pinned_keys import PinnedKeyRing
from control_plane.api.fleet_convert import attributes_pb
from tests.control_plane.api._attack_helpers import (
    ANDROID,
    code_of,
    enroll,
    rollout,
    sync_with,
    token_for,
)
from tests.control_plane.api._attack_helpers import fresh as fresh  # fixture
from tests.control_plane.api._attack_helpers import plane as plane  # fixture
from tests.control_plane.api._attack_helpers import run_id as run_id  # fixture
from tests.control_plane.api.device_helpers import Device, run


class Health:
    """A health-check client whose channel is connected before it is timed."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._channel = channel
        self._stub = health_pb2_grpc.HealthStub(self._channel)
        self.latency()  # connect now

    def latency(self) -> float:
        started = time.monotonic()
        self._stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        return time.monotonic() - started

    def close(self) -> None:
        self._channel.close()


# -- problems the review confirmed (each failed before its fix) -------------------------------


def test_revocation_racing_a_credential_lookup_is_not_forgotten(plane, run_id, monkeypatch):
    """The auth cache can keep a revoked device's credential alive for 30 s.

    `Fleet.authenticate` reads the device, then caches it. A revocation that commits
    between the read and the insert evicts nothing (the entry is not there yet), and the
    stale 'not revoked' entry is then cached: the device keeps Syncing (and receiving
    freshly wrapped data keys) for AUTH_CACHE_TTL_S on that replica.
    """
    cp = plane
    device = enroll(cp, run_id)
    real = cp.app.store.find_device
    fired: list[str] = []

    def lookup_then_revocation_commits(digest):
        found = real(digest)
        if found is not None and not fired:
            fired.append(found.id)
            cp.app.fleet.revoke(found.id, reason="stolen")  # commits; feed evicts the cache
        return found

    monkeypatch.setattr(cp.app.store, "find_device", lookup_then_revocation_commits)
    device.sync_raw()  # in flight while the revocation commits: may still be answered
    assert fired == [device.id]
    # Every later call must be refused.
    assert code_of(device.sync_raw) == grpc.StatusCode.PERMISSION_DENIED


def test_unauthenticated_sync_does_not_stall_the_server(fresh):
    """Device calls do blocking database work on the event loop.

    Sync, Watch and Download are coroutines but call `Fleet.authenticate` (a database
    lookup on every unknown credential; nothing negative is cached) and `Delivery.sync`
    (snapshot reloads, version reads, KEK unwraps) synchronously. While the database is
    slow or locked (on SQLite every read takes the write lock, so any concurrent write
    does it) one unauthenticated Sync with a made-up credential freezes every stream and
    call on the server, health checks included.
    """
    cp = fresh
    health = Health(cp.channel())
    if cp.app.store.dialect == "sqlite":
        path = cp.app.store.url.split("///", 1)[1]
        locker = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        locker.execute("BEGIN IMMEDIATE")  # what any writer (push, enroll, flush) holds
    else:
        import psycopg
        from sqlalchemy.engine import make_url

        url = make_url(cp.app.store.url).set(drivername="postgresql")
        locker = psycopg.connect(url.render_as_string(hide_password=False))
        locker.execute("LOCK TABLE devices IN ACCESS EXCLUSIVE MODE")  # e.g. a migration
    release = threading.Timer(2.5, locker.commit)
    stranger = Device(
        cp.address, "dev_x", "skd_" + secrets.token_urlsafe(32), None, [], {}, PinnedKeyRing([])
    )
    attempt = threading.Thread(target=lambda: code_of(stranger.sync_raw), daemon=True)
    try:
        assert health.latency() < 0.5
        attempt.start()
        time.sleep(0.3)  # the made-up credential is being looked up now
        release.start()
        latency = health.latency()
    finally:
        if release.is_alive():
            release.join()
        locker.commit()  # a no-op once the timer did it
        attempt.join(15)
        locker.close()
        health.close()
    assert latency < 1.0, f"a health check took {latency:.1f}s behind one bogus Sync"


# -- attacks that are refused today (regression tests) ----------------------------------------


def test_single_use_token_used_by_many_devices_at_once(plane, run_id):
    cp = plane
    token = token_for(cp, run_id, uses=1)
    keys = [DeviceKeyPair.generate().public_keyset() for _ in range(12)]
    barrier = threading.Barrier(len(keys))

    def attempt(keyset):
        barrier.wait()
        try:
            run(cp.address, "", lambda c: c.enroll(token, attributes_pb({}), keyset))
            return "ok"
        except DeviceCallError as exc:
            return exc.code

    with concurrent.futures.ThreadPoolExecutor(len(keys)) as pool:
        results = list(pool.map(attempt, keys))
    assert results.count("ok") == 1
    assert set(results) - {"ok"} == {grpc.StatusCode.UNAUTHENTICATED}
    with cp.client() as client:
        assert len(client.list_devices(f"custom.run={run_id}")) == 1


def test_bad_enrollment_tokens(plane, run_id):
    cp = plane
    keyset = DeviceKeyPair.generate().public_keyset()
    good = token_for(cp, run_id)
    with cp.client() as client:
        expired = client.create_enrollment_token(ttl_s=1).token
    time.sleep(1.1)
    for token in (
        expired,
        good + "x",
        good[:-1],
        "ske_" + "A" * 5000,
        "ske_\x00" + good[5:],
        "ske_\u202e" + good[5:],
        good.upper(),
        " " + good,
    ):
        assert (
            code_of(
                lambda t=token: run(
                    cp.address, "", lambda c: c.enroll(t, attributes_pb({}), keyset)
                )
            )
            == grpc.StatusCode.UNAUTHENTICATED
        ), repr(token[:12])


def test_stamped_attributes_cannot_be_overridden(plane, run_id):
    """Stamped keys win on enrollment and on every Sync: standard, custom (any case
    variation is a different key) and tags (stamped tags cannot be dropped)."""
    cp = plane
    stamps = {"region": "eu", "tags": ["managed"], "custom": {"tier": "gold"}}
    token = token_for(cp, run_id, attributes=stamps)
    claims = {
        **ANDROID,
        "region": "us",
        "tags": ["beta"],
        "custom": {"tier": "platinum", "Tier": "platinum", "run": "someone-else"},
    }
    device = Device.enroll(cp.address, token, claims)
    for selector in (
        "region=us",
        "region in (us, EU)",
        "custom.tier=platinum",
        "tags not in (managed)",
    ):
        rollout(cp, run_id, 1, selector)
    escape = {**claims, "region": "EU", "tags": []}
    response = sync_with(device, escape)
    assert list(response.models) == []
    with cp.client() as client:
        shown = client.get_device(device.id).attributes
        assert (shown.region, shown.custom["tier"], shown.custom["run"]) == ("eu", "gold", run_id)
        assert "managed" in shown.tags
    # A device that says nothing about itself still carries its stamps.
    rollout(cp, run_id, 2, "region=eu, custom.tier=gold, tags=managed")
    assert [m.version for m in sync_with(device, {}).models] == [2]


def test_no_secrets_in_logs(plane, run_id, caplog):
    cp = plane
    caplog.set_level(logging.DEBUG)
    token = token_for(cp, run_id)
    device = enroll(cp, run_id, token=token)
    rollout(cp, run_id, 1)
    verified = device.sync()
    device.install(verified, "det")
    m = verified.models["det"]
    data_key = device.keys.unwrap(m.wrapped_data_key, device_id=device.id, version_uid=m.uid)
    # Error paths too: wrong credentials, wrong tokens, revocation.
    for credential in (device.credential + "x", "Bearer " + device.credential):
        stranger = Device(
            cp.address, device.id, credential, device.keys, [], ANDROID, PinnedKeyRing([])
        )
        code_of(stranger.sync_raw)
    code_of(lambda: Device.enroll(cp.address, token + "x"))
    code_of(lambda: Device.enroll(cp.address, token, {"platform": "a" * 500}))
    with cp.client() as client:
        client.revoke_device(device.id, "lost")
    code_of(device.sync_raw)
    text = caplog.text
    for secret in (
        token,
        token[4:],
        device.credential,
        device.credential[4:],
        data_key.hex(),
        base64.b64encode(data_key).decode(),
        repr(data_key)[2:-1],
    ):
        assert secret not in text
    assert "ske_" not in text and "skd_" not in text
