"""The health service says NOT_SERVING while the database or blob store is unreachable."""

from __future__ import annotations

import logging
import time
import uuid

import boto3
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from sqlalchemy import text

from tests.conftest import _pg_admin_engine, fresh_pg_database
from tests.control_plane.helpers import channel_to, start_control_plane

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICES = ("", "skiff.v1.AdminService", "skiff.v1.DeviceService")


def _statuses(address: str) -> set[int]:
    with channel_to(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            for name in SERVICES
        }


def _wait_for(address: str, status: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while (seen := _statuses(address)) != {status}:
        assert time.monotonic() < deadline, f"health stayed {seen}, expected {status}"
        time.sleep(0.1)


def _transitions(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("health:")]


def test_a_missing_blob_root_is_not_serving_until_it_is_back(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    plane = start_control_plane(tmp_path / "home", health_interval_s=0.1)
    try:
        root = plane.registry.blobs.root
        _wait_for(plane.address, SERVING)
        # Root runs the tests, so permissions stop nothing: take the directory away
        # (the local store refuses a missing root: it may be an unmounted volume).
        root.rename(tmp_path / "unmounted")
        _wait_for(plane.address, NOT_SERVING)
        time.sleep(0.5)  # several more failed probes: still one transition logged
        (tmp_path / "unmounted").rename(root)
        _wait_for(plane.address, SERVING)
    finally:
        plane.stop()
    logged = _transitions(caplog)
    assert len(logged) == 2, logged
    assert logged[0].startswith("health: NOT_SERVING (blob store: ") and "missing" in logged[0]
    assert logged[1] == "health: SERVING again (database and blob store reachable)"


@pytest.mark.postgres
def test_an_unreachable_database_is_not_serving_until_it_is_back(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    with fresh_pg_database() as url:
        name = url.rsplit("/", 1)[1]
        plane = start_control_plane(tmp_path / "home", db=url, health_interval_s=0.1)
        admin = _pg_admin_engine()
        try:
            _wait_for(plane.address, SERVING)
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
                conn.execute(
                    text(
                        "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :d"
                    ),
                    {"d": name},
                )
            _wait_for(plane.address, NOT_SERVING)
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            _wait_for(plane.address, SERVING)
        finally:
            with admin.connect() as conn:
                conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            admin.dispose()
            plane.stop()
    logged = _transitions(caplog)
    assert len(logged) == 2, logged
    assert logged[0].startswith("health: NOT_SERVING (database: database unavailable")
    assert logged[1].startswith("health: SERVING again")


def test_a_stopped_s3_server_is_not_serving_until_it_is_back(tmp_path, monkeypatch):
    from moto.server import ThreadedMotoServer

    # A server of this test's own, to stop and start again; moto needs some credentials.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    port = server._server.server_port
    endpoint = f"http://127.0.0.1:{port}"
    bucket = f"skiff-health-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
    plane = start_control_plane(
        tmp_path / "home",
        blobs=f"s3://{bucket}?endpoint_url={endpoint}&region=us-east-1",
        health_interval_s=0.1,
    )
    try:
        _wait_for(plane.address, SERVING)
        server.stop()
        _wait_for(plane.address, NOT_SERVING)
        # The same port again (moto keeps its buckets in this process's memory).
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        server.start()
        _wait_for(plane.address, SERVING)
    finally:
        plane.stop()
        server.stop()
