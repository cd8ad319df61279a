"""`pip install skiff` without extras: the device side alone, against a full control plane.

A wheel of the checkout goes into a fresh venv with no extras, and everything runs from
a folder outside the checkout, so nothing of the full install can stand in for what the
wheel lacks. The control plane is this suite's own (the full install).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from runtime.npz import write_npz
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_agent import rollout, token

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
# What only the control plane, the operator's commands and the dashboard need.
SERVER_ONLY = frozenset(
    {"sqlalchemy", "alembic", "psycopg", "psycopg-binary", "boto3", "flask", "plotly", "onnx"}
)
X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


def _env(root: Path) -> dict[str, str]:
    """The environment of the device venv's commands: nothing pointing into the checkout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SKIFF_", "PYTHON"))}
    env.pop("VIRTUAL_ENV", None)
    return env | {"SKIFF_HOME": str(root / "skiff-home"), "PYTHONNOUSERSITE": "1"}


class DeviceVenv:
    """A venv holding the wheel alone; runs its commands from outside the checkout."""

    def __init__(self, root: Path) -> None:
        self.root, self.path, self.env = root, root / "venv", _env(root)

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
        program, *rest = argv
        return subprocess.run(
            [str(self.path / "bin" / program), *rest],
            capture_output=True,
            text=True,
            cwd=self.root,
            env=self.env,
            timeout=timeout,
        )

    def skiff(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return self.run("skiff", *args, timeout=timeout)


@pytest.fixture(scope="module")
def device(tmp_path_factory) -> DeviceVenv:
    root = tmp_path_factory.mktemp("agent-only")
    wheels = root / "wheels"
    build = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), "."]
    if importlib.util.find_spec("scikit_build_core") and importlib.util.find_spec("pybind11"):
        # The build backend is installed (make install, which builds the editable install
        # the same way): no isolated build env, so the wheel reuses the extension already
        # built in build/{wheel_tag} (pyproject.toml) and takes seconds, not a compile.
        build.insert(4, "--no-build-isolation")
    built = subprocess.run(build, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    venv = DeviceVenv(root)
    subprocess.run([sys.executable, "-m", "venv", str(venv.path)], check=True, timeout=120)
    [wheel] = wheels.glob("skiff-*.whl")
    installed = venv.run(
        "pip", "install", "-q", "--disable-pip-version-check", str(wheel), timeout=600
    )
    assert installed.returncode == 0, installed.stderr
    return venv


def test_the_wheel_alone_installs_no_server_dependency(device):
    listed = device.run("pip", "list", "--format=json", "--disable-pip-version-check")
    names = {p["name"].lower().replace("_", "-") for p in json.loads(listed.stdout)}
    assert not names & SERVER_ONLY, sorted(names & SERVER_ONLY)
    assert {"skiff", "grpcio", "protobuf", "numpy", "mnn", "tink", "cryptography"} <= names
    # The checkout is not what runs: the packages are the venv's own copies.
    where = device.run(
        "python", "-c", "import control_plane, device_agent; print(device_agent.__file__)"
    )
    assert where.stdout.startswith(str(device.path)), where.stdout + where.stderr


def test_an_operator_command_names_the_extra_in_one_line(device):
    done = device.skiff("model", "ls")
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "skiff: 'skiff model' is an operator command, and this install has the device side "
        "only: pip install 'skiff[server]'"
    ]
    helped = device.skiff("--help")
    assert helped.returncode == 0 and "agent" in helped.stdout and "skiff[server]" in helped.stdout
    version = device.skiff("--version")
    assert version.returncode == 0 and version.stdout.strip().endswith("(device side)")


def test_the_device_side_enrolls_installs_self_tests_and_serves(cp, device, tmp_path):
    rollout(cp, 1)
    state = tmp_path / "state"
    dial = ["--server", f"127.0.0.1:{cp.port}", "--ca", str(cp.config.home / "tls" / "ca.pem")]
    enroll = ["--state", str(state), "--enroll-token", token(cp)]
    once = device.skiff("agent", "run", *dial, *enroll, "--once", timeout=240)
    assert once.returncode == 0, once.stderr
    shown = device.skiff("agent", "status", "--state", str(state), "--json")
    active = json.loads(shown.stdout)["models"][MODEL]["active"]
    assert active["version"] == 1 and active["config"]  # self-tested on golden data

    daemon = subprocess.Popen(
        [str(device.path / "bin" / "skiff"), "agent", "run", *dial, "--state", str(state)],
        stderr=subprocess.PIPE,
        text=True,
        cwd=device.root,
        env=device.env,
    )
    try:
        inputs = tmp_path / "in.npz"
        inputs.write_bytes(write_npz({"x": X}))
        infer = ["infer", "--state", str(state), MODEL, "--input", str(inputs), "--json"]
        deadline = time.monotonic() + 120
        while True:
            assert daemon.poll() is None, daemon.communicate()[1]
            answer = device.skiff(*infer, timeout=60)
            if answer.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert answer.returncode == 0, answer.stderr
        body = json.loads(answer.stdout)
        (output,) = body["outputs"].values()
        assert body["version"] == 1 and output["shape"] == [1, 4]
    finally:
        daemon.send_signal(signal.SIGTERM)
        _, stderr = daemon.communicate(timeout=60)
    assert daemon.returncode == 0, stderr
