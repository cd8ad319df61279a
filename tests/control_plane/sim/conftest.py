"""Real control planes with two versions of a model pushed, restartable on their port.

Pushing runs MNN, so the versions are pushed once into a template home; each test serves
a copy of it (its own database, blobs and keys), so rollouts never leak between tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from control_plane.app import build_app
from control_plane.demo import sample_models
from control_plane.home import read_token
from control_plane.serve import create_server
from control_plane.settings import load_config
from tests.conftest import fresh_pg_database
from tests.control_plane import helpers
from tests.control_plane.helpers import ControlPlane, start_control_plane

MODEL = "det"


def serve(home: Path, address: str = "127.0.0.1:0", **settings) -> ControlPlane:
    """Serve an initialised home (the helpers' start_control_plane makes a new one)."""
    config = load_config(home, {"grpc": address, **settings}, environ={})
    app = build_app(config)
    server, port = create_server(config, app, address)
    server.start()
    return ControlPlane(config, app, server, port, read_token(home))


def restart(cp: ControlPlane) -> ControlPlane:
    """Stop `cp` and serve the same home again on the same port."""
    cp.stop()
    for _ in range(50):  # the old listener may take a moment to let go of the port
        try:
            return serve(cp.config.home, cp.address)
        except Exception:  # noqa: BLE001 - errors.Unavailable or a bind error
            time.sleep(0.1)
    raise AssertionError(f"cannot listen on {cp.address} again")


def wait_for(check, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def wait_progressing(check, progress, stall_s: float, what: str, cap_s: float = 900.0):
    """Wait for `check()` to return something truthy, bounded by progress, not a total.

    The wait runs on while `progress()` (what the awaited thing depends on: reports in, audit
    events) changes at least once every `stall_s`, which a loaded machine slows but does not
    stop; it fails when nothing moved for `stall_s`, or after `cap_s` in all.
    """
    start = time.monotonic()
    deadline, last = start + stall_s, progress()
    while time.monotonic() < min(deadline, start + cap_s):
        value = check()
        if value:
            return value
        now = progress()
        if now != last:
            last, deadline = now, time.monotonic() + stall_s
        time.sleep(0.1)
    why = f"no progress for {stall_s} s" if time.monotonic() >= deadline else f"{cap_s} s in all"
    raise AssertionError(f"timed out waiting for {what}: {why} (last {last})")


def _template(home: Path, **settings) -> Path:
    """Push det:1 and det:2 into a new home; return it, stopped."""
    cp = start_control_plane(home, **settings)
    try:
        with cp.client() as client:
            for version in (1, 2):
                path = home.parent / f"det-{version}.onnx"
                path.write_bytes(sample_models.tiny_mlp_onnx(seed=version))
                client.push(path, name=MODEL)
    finally:
        cp.stop()
    return cp.config.home


@pytest.fixture(scope="session")
def template_home(tmp_path_factory) -> Path:
    return _template(tmp_path_factory.mktemp("sim-template") / "home")


@pytest.fixture(scope="session")
def pg_template(tmp_path_factory) -> Iterator[tuple[Path, str]]:
    """The template on PostgreSQL: its home and its database (copy both, `pg_copy`)."""
    with fresh_pg_database() as url:
        yield _template(tmp_path_factory.mktemp("sim-pg-template") / "home", db=url), url


def copy_home(template_home: Path, tmp_path: Path) -> Path:
    """Copy the template home (its own database, blobs and keys) to `tmp_path/home`."""
    home = tmp_path / "home"
    helpers.copy_home(template_home, home)
    return home


@pytest.fixture
def cp_holder(template_home, tmp_path):
    """A control plane of its own in a dict under "cp", so a test that restarts it can swap it."""
    holder = {"cp": serve(copy_home(template_home, tmp_path))}
    yield holder
    holder["cp"].stop()
