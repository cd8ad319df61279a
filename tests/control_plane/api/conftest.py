from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from control_plane.demo import sample_models
from tests.conftest import fresh_pg_database
from tests.control_plane.helpers import copy_home, start_control_plane

SETTINGS = {"scheduler_interval_s": 0.2, "device_flush_s": 0.1}


@pytest.fixture(scope="module")
def onnx_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("models") / "det.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=1))
    return path


def _push_det(cp, onnx_path: Path) -> None:
    """Publish det:1 (fp32) and det:2 (fp32 + int8) from the same ONNX file."""
    with cp.client() as client:
        client.push(onnx_path, name="det")
        client.push(onnx_path, name="det", variants=("int8",))


@pytest.fixture(scope="session")
def published_template(tmp_path_factory) -> Iterator[Callable[[str], tuple[Path, str | None]]]:
    """Return `get(kind)`: a stopped home (and PostgreSQL database) with det:1 and det:2.

    Pushing runs MNN in child processes (seconds); each worker builds one home per
    database kind, on first use, and every `published` test starts from a copy of it.
    """
    built: dict[str, tuple[Path, str | None]] = {}
    with contextlib.ExitStack() as stack:

        def get(kind: str) -> tuple[Path, str | None]:
            if kind not in built:
                settings = dict(SETTINGS)
                if kind == "postgresql":
                    settings["db"] = stack.enter_context(fresh_pg_database())
                home = tmp_path_factory.mktemp(f"published-{kind}") / "home"
                cp = start_control_plane(home, **settings)
                try:
                    onnx = home.parent / "det.onnx"
                    onnx.write_bytes(sample_models.tiny_mlp_onnx(seed=1))
                    _push_det(cp, onnx)
                finally:
                    cp.stop()
                built[kind] = home, settings.get("db")
            return built[kind]

        yield get


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def cp(request, tmp_path):
    """A control plane of the test's own; for a test that asks for `published` as well,
    one that starts from a copy of the published template instead of an empty home."""
    settings = dict(SETTINGS)
    home = tmp_path / "home"
    if "published" in request.fixturenames:
        template_home, template_db = request.getfixturevalue("published_template")(request.param)
        copy_home(template_home, home)
        if template_db is not None:
            settings["db"] = request.getfixturevalue("pg_copy")(template_db)
    elif request.param == "postgresql":
        settings["db"] = request.getfixturevalue("pg_url")
    plane = start_control_plane(home, **settings)
    yield plane
    plane.stop()


@pytest.fixture
def published(cp):
    """The control plane with det:1 and det:2 (fp32 + int8) pushed."""
    return cp


@pytest.fixture
def enroll_token(cp):
    with cp.client() as client:
        return client.create_enrollment_token().token


@pytest.fixture(autouse=True)
def _enroll_throttle_per_test(request):
    """Tests sharing one control plane (the attack modules' `plane`) each guess from the
    same address: each starts with the Enroll throttle's counts forgotten, as if it came
    from an address of its own."""
    if "plane" in request.fixturenames:
        request.getfixturevalue("plane").app.enroll_throttle.forget()
