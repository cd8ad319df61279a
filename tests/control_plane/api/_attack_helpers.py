"""Fixtures and helpers shared by the attack tests (test_device_attacks_*.py).

Every attack test drives a real control plane over gRPC. The tests for the problems the
review confirmed (each failed before its fix) name the problem in their docstring; the
others are regression tests for attacks that were refused from the start.

Most tests share one published control plane per database and test module (pushing models
through MNN is slow); each isolates itself with a run id stamped on its devices as the custom
attribute `run` and used in its rollouts' selectors. Tests that break or lock the server get
their own plane (the `fresh` fixture).

Each test module imports the fixtures by name, as `plane as plane`: the tests name them only
as parameters, and the redundant alias tells ruff the import is deliberate (F401, F811).
"""

from __future__ import annotations

import contextlib
import secrets

import grpc
import pytest

from contract import errors
from contract.device_client import DeviceCallError
from control_plane.api.fleet_convert import attributes_pb
from control_plane.api.grpc_errors import status_for
from protos import device_pb2, fleet_pb2
from tests.conftest import fresh_pg_database
from tests.control_plane.api.device_helpers import Device, run
from tests.control_plane.helpers import copy_home, start_control_plane

ANDROID = {"platform": "android", "app_version": "5.3", "soc": "sm8650"}
PG = pytest.param("postgresql", marks=pytest.mark.postgres)


@pytest.fixture(scope="module", params=["sqlite", PG])
def plane(request, tmp_path_factory, published_template):
    """One control plane per database with det:1 (fp32) and det:2 (fp32 + int8) pushed.

    Device reports are written behind every 30 s here (0.5 s by default) so that the
    window between a Sync and its write is wide enough to test deterministically; reads
    that must see the reports (ListDevices, GetDevice, GetRollout) flush first anyway.
    """
    settings = {"scheduler_interval_s": 0.2, "device_flush_s": 30.0}
    template_home, template_db = published_template(request.param)
    home = tmp_path_factory.mktemp("plane") / "home"
    copy_home(template_home, home)
    with contextlib.ExitStack() as stack:
        if template_db is not None:
            settings["db"] = stack.enter_context(fresh_pg_database(template=template_db))
        cp = start_control_plane(home, **settings)
        try:
            yield cp
        finally:
            cp.stop()


@pytest.fixture(params=["sqlite", PG])
def fresh(request, tmp_path):
    """A control plane of its own (nothing pushed), for tests that break or lock it.

    Its teardown tolerates a server that cannot stop cleanly (a poisoned write-behind
    batch makes `stop` raise on PostgreSQL); that is reported by the tests themselves.
    """
    settings = {"device_flush_s": 0.1}
    if request.param == "postgresql":
        settings["db"] = request.getfixturevalue("pg_url")
    cp = start_control_plane(tmp_path / "home", **settings)
    yield cp
    try:
        cp.stop()
    except errors.SkiffError:
        cp.app.feed.close()
        cp.app.store.close()


@pytest.fixture
def run_id() -> str:
    return "r" + secrets.token_hex(6)


def token_for(cp, run_id: str, **kw) -> str:
    """An enrollment token stamping `run` on its devices (the test's isolation)."""
    attributes = kw.pop("attributes", {})
    attributes.setdefault("custom", {})["run"] = run_id
    with cp.client() as client:
        return client.create_enrollment_token(attributes=attributes, **kw).token


def enroll(cp, run_id: str, attrs: dict | None = None, token: str | None = None) -> Device:
    device = Device.enroll(cp.address, token or token_for(cp, run_id), dict(attrs or ANDROID))
    device.attributes = {**device.attributes, "custom": {"run": run_id}}
    return device


def rollout(cp, run_id: str, version: int = 1, selector: str = "", **kw) -> fleet_pb2.Rollout:
    full = f"custom.run={run_id}" + (f", {selector}" if selector else "")
    kw.setdefault("allow_empty", True)  # these aim at no device on purpose, often
    with cp.client() as client:
        return client.create_rollout(
            fleet_pb2.CreateRolloutRequest(model="det", version=version, selector=full, **kw)
        )


def code_of(fn) -> grpc.StatusCode:
    """The status code `fn` fails with (device calls and admin calls alike)."""
    with pytest.raises((DeviceCallError, errors.SkiffError)) as caught:
        fn()
    if isinstance(caught.value, DeviceCallError):
        return caught.value.code
    return status_for(caught.value)


def sync_with(device: Device, attributes=None, installed=()) -> device_pb2.SyncResponse:
    """A raw Sync with any attributes (a dict or a message) and installed list."""
    if isinstance(attributes, device_pb2.DeviceAttributes):
        attrs = attributes
    else:
        attrs = attributes_pb(attributes or {})
    return run(
        device.address,
        device.credential,
        lambda c: c.sync(attrs, list(installed), 0, nonce=b"\0" * 16),
    )
