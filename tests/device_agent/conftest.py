"""A real control plane with two versions of a model, and agents over state directories."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from control_plane.demo import sample_models
from control_plane.settings import CONFIG_FILE
from tests.control_plane.helpers import ControlPlane, start_control_plane
from tests.control_plane.sim.conftest import serve

MODEL = "det"


@pytest.fixture(scope="session")
def agent_template(tmp_path_factory) -> Path:
    """A home with det v1 and v2 pushed (pushing runs MNN: once per session)."""
    tmp = tmp_path_factory.mktemp("agent-template")
    cp = start_control_plane(tmp / "home")
    try:
        with cp.client() as client:
            for version in (1, 2):
                path = tmp / f"det-{version}.onnx"
                path.write_bytes(sample_models.tiny_mlp_onnx(seed=version))
                client.push(path, name=MODEL)
    finally:
        cp.stop()
    return cp.config.home


@pytest.fixture
def cp(agent_template, tmp_path) -> ControlPlane:
    """A control plane of its own, serving a copy of the template home."""
    home = tmp_path / "home"
    shutil.copytree(agent_template, home)
    config = home / CONFIG_FILE
    config.write_text(config.read_text().replace(str(agent_template), str(home)))
    cp = serve(home)
    yield cp
    cp.stop()


def blob_path(cp: ControlPlane, digest: str) -> Path:
    """Return where the local blob store keeps `digest`."""
    found = [p for p in (cp.config.home / "blobs").rglob(digest) if p.is_file()]
    assert len(found) == 1, found
    return found[0]
