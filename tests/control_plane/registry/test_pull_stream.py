"""A pull's chunk stream through a real server."""

from __future__ import annotations

import pytest

from control_plane.demo import sample_models
from tests.control_plane.helpers import start_control_plane


@pytest.fixture(scope="module")
def big_mnn() -> bytes:
    # Several 1 MiB chunks (the other tests' models fit in one).
    return sample_models.onnx_to_mnn_bytes(sample_models.sized_mlp_onnx(3_500_000, seed=5))


@pytest.fixture
def cp(tmp_path):
    plane = start_control_plane(tmp_path / "home")
    yield plane
    plane.stop()


def test_a_model_of_many_chunks_comes_back_whole(cp, tmp_path, big_mnn):
    model = tmp_path / "big.mnn"
    model.write_bytes(big_mnn)
    with cp.client() as client:
        client.push(model, name="big")
        client.pull("big", 1, tmp_path / "back.mnn", pins=cp.pins)
    assert (tmp_path / "back.mnn").read_bytes() == big_mnn
