from __future__ import annotations

import pytest

from control_plane.demo import sample_models
from tests.control_plane.helpers import start_control_plane


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "det.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=1))
    return path


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def cp(request, tmp_path):
    settings = {"scheduler_interval_s": 0.2, "device_flush_s": 0.1}
    if request.param == "postgresql":
        settings["db"] = request.getfixturevalue("pg_url")
    plane = start_control_plane(tmp_path / "home", **settings)
    yield plane
    plane.stop()


@pytest.fixture
def published(cp, onnx_path):
    """The control plane with det:1 and det:2 (fp32 + int8) pushed."""
    with cp.client() as client:
        client.push(onnx_path, name="det")
        client.push(onnx_path, name="det", variants=("int8",))
    return cp


@pytest.fixture
def enroll_token(cp):
    with cp.client() as client:
        return client.create_enrollment_token().token
