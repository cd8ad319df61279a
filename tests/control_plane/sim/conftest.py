"""A real control plane with two versions of a model pushed, restartable on its port."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from control_plane.api.server import build_app, create_server
from control_plane.demo import sample_models
from tests.control_plane.helpers import ControlPlane, start_control_plane

MODEL = "det"


def push_versions(cp: ControlPlane, tmp: Path, count: int = 2) -> None:
    with cp.client() as client:
        for seed in range(1, count + 1):
            path = tmp / f"det-{seed}.onnx"
            path.write_bytes(sample_models.tiny_mlp_onnx(seed=seed))
            client.push(path, name=MODEL)


def restart(cp: ControlPlane) -> ControlPlane:
    """Stop `cp` and serve the same home again on the same port."""
    cp.stop()
    app = build_app(cp.config)
    for _ in range(50):  # the old listener may take a moment to let go of the port
        try:
            server, port = create_server(cp.config, app, cp.address)
            break
        except Exception:  # noqa: BLE001 - errors.Unavailable or a bind error
            time.sleep(0.1)
    else:
        raise AssertionError(f"cannot listen on {cp.address} again")
    server.start()
    return ControlPlane(cp.config, app, server, port, cp.token)


def wait_for(check, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def cp(tmp_path):
    """A control plane of its own per test (rollouts would leak between tests)."""
    holder = {"cp": start_control_plane(tmp_path / "home")}
    push_versions(holder["cp"], tmp_path)
    yield holder
    holder["cp"].stop()
