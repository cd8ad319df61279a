"""A real control plane with two versions of a model, and agents over state directories."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from control_plane.settings import CONFIG_FILE
from tests.control_plane.helpers import ControlPlane

# The simulator's template home already holds det v1 and v2: push them once, not twice.
from tests.control_plane.sim.conftest import MODEL, serve, template_home  # noqa: F401


@pytest.fixture
def cp(request, template_home, tmp_path) -> ControlPlane:  # noqa: F811 - imported fixture
    """A control plane of its own, serving a copy of the template home.

    A module's CONTROL_PLANE_SETTINGS (a dict) are its server's settings.
    """
    home = tmp_path / "home"
    shutil.copytree(template_home, home)
    config = home / CONFIG_FILE
    config.write_text(config.read_text().replace(str(template_home), str(home)))
    cp = serve(home, **getattr(request.module, "CONTROL_PLANE_SETTINGS", {}))
    yield cp
    cp.stop()


def blob_path(cp: ControlPlane, digest: str) -> Path:
    """Return where the local blob store keeps `digest`."""
    found = [p for p in (cp.config.home / "blobs").rglob(digest) if p.is_file()]
    assert len(found) == 1, found
    return found[0]
