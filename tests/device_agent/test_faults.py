"""Power cuts and bad disks: SIGKILL at each step of an install, a full disk, a bad segment.

Each crash is a real SIGKILL of a real `skiff agent run --once` process
(`tests/device_agent/crash_agent.py` picks the instant); the agent started again must
stand on exactly one consistent version and finish the install without fetching what
it already holds verified.
"""

from __future__ import annotations

import asyncio
import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from contract.device_client import DeviceConnection
from contract.envelope import SEGMENT_SIZE
from control_plane.demo import sample_models
from device_agent import download, install
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_agent import once, rollout, status, token

REPO = Path(__file__).resolve().parents[2]
# The one-artifact format (its segments, resumes and renames) under faults; chunked
# versions' faults are tests/device_agent/test_chunked_updates.py's.
CONTROL_PLANE_SETTINGS = {"chunk_min_bytes": 0}


def crash_run(cp, state: Path, point: str, *args: str) -> subprocess.CompletedProcess:
    ca = cp.config.home / "tls" / "ca.pem"
    done = subprocess.run(
        [sys.executable, "-m", "tests.device_agent.crash_agent", "agent", "run"]
        + ["--server", f"127.0.0.1:{cp.port}", "--ca", str(ca), "--state", str(state)]
        + ["--once", *args],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=REPO,
        env={**os.environ, "SKIFF_TEST_CRASH": point},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr
    return done


def push_big(cp, tmp_path, mb: float = 3.5) -> tuple[int, str, int]:
    """Push a model of several segments; return its version, ciphertext digest and size."""
    path = tmp_path / "big.onnx"
    path.write_bytes(sample_models.sized_mlp_onnx(int(mb * (1 << 20)), seed=9))
    with cp.client() as client:
        version = client.push(path, name=MODEL).version
    _, [v] = cp.registry.show(MODEL, version)
    fp32 = v.variant("fp32")
    assert fp32.ciphertext_size > 3 * SEGMENT_SIZE
    return version, fp32.ciphertext_sha256, fp32.ciphertext_size


def test_sigkill_mid_download_resumes_at_the_last_verified_segment(cp, tmp_path):
    version, digest, size = push_big(cp, tmp_path)
    state = tmp_path / "s"
    rollout(cp, version)
    cut = 2 * SEGMENT_SIZE + SEGMENT_SIZE // 2  # the third segment half written
    crash_run(cp, state, f"download:{cut}", "--enroll-token", token(cp))
    part = state / "artifacts" / f"{digest}.part"
    assert part.stat().st_size == cut
    outcome = asyncio.run(once(cp, state))
    timings = outcome.installs[0].timings
    assert outcome.converged
    # The two verified segments were kept; the cut one was fetched again, nothing else.
    assert (timings.resumed_from, timings.downloaded_bytes) == (
        2 * SEGMENT_SIZE,
        size - 2 * SEGMENT_SIZE,
    )
    assert not part.exists() and (state / "artifacts" / digest).stat().st_size == size


def test_sigkill_before_the_downloads_rename_keeps_the_verified_file(cp, tmp_path):
    version, digest, size = push_big(cp, tmp_path)
    assert size % SEGMENT_SIZE  # the last segment is a short one
    state = tmp_path / "s"
    rollout(cp, version)
    crash_run(cp, state, "rename", "--enroll-token", token(cp))
    assert (state / "artifacts" / f"{digest}.part").stat().st_size == size
    outcome = asyncio.run(once(cp, state))
    assert outcome.converged
    timings = outcome.installs[0].timings
    assert (timings.resumed_from, timings.downloaded_bytes) == (size, 0)


def test_a_byte_flipped_in_transit_costs_one_segment(cp, tmp_path, monkeypatch):
    version, digest, size = push_big(cp, tmp_path)
    state = tmp_path / "s"
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    rollout(cp, version)
    real = DeviceConnection.download

    async def flipping(self, artifact, *, size, offset=0):
        async for at, data in real(self, artifact, size=size, offset=offset):
            target = SEGMENT_SIZE + 100  # inside the second segment
            if at <= target < at + len(data):
                data = bytearray(data)
                data[target - at] ^= 0x01
                data = bytes(data)
            yield at, data

    monkeypatch.setattr(DeviceConnection, "download", flipping)
    outcome = asyncio.run(once(cp, state))
    (failed,) = outcome.installs
    assert (
        failed.result == "failed" and "segment 1 does not match its signed digest" in failed.reason
    )
    part = state / "artifacts" / f"{digest}.part"
    assert part.stat().st_size == SEGMENT_SIZE  # only the verified segment reached the disk
    assert status(state)["models"][MODEL]["active"] is None
    monkeypatch.setattr(DeviceConnection, "download", real)
    again = asyncio.run(once(cp, state))
    assert again.converged
    assert again.installs[0].timings.resumed_from == SEGMENT_SIZE


def test_sigkill_between_download_and_activation_restarts_on_the_old_version(cp, tmp_path):
    state = tmp_path / "s"
    rollout(cp, 1)
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    rollout(cp, 2)
    crash_run(cp, state, "self-test")
    model = status(state)["models"][MODEL]
    assert model["active"]["version"] == 1 and model["failed"] is None
    outcome = asyncio.run(once(cp, state))
    assert outcome.converged
    # The artifact downloaded before the crash was kept: not one byte fetched again.
    assert outcome.installs[0].timings.downloaded_bytes == 0
    model = status(state)["models"][MODEL]
    assert (model["active"]["version"], model["previous"]["version"]) == (2, 1)


@pytest.mark.parametrize(("when", "expected"), [("before", 1), ("after", 2)])
def test_sigkill_during_the_pointer_swap_leaves_one_consistent_version(
    cp, tmp_path, when, expected
):
    state = tmp_path / "s"
    rollout(cp, 1)
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    rollout(cp, 2)
    crash_run(cp, state, f"pointer:{when}:2")
    model = status(state)["models"][MODEL]
    assert model["active"]["version"] == expected
    # Whichever pointer survived names an artifact that is whole and loads.
    installer = install.Installer(install.StateDir(state), _unwrapper(state), None)
    loaded = installer.load(MODEL, installer.pointer(MODEL)["active"])
    loaded.close()
    outcome = asyncio.run(once(cp, state))
    assert outcome.converged
    assert status(state)["models"][MODEL]["active"]["version"] == 2


def _unwrapper(state: Path):
    from contract.key_wrap import DeviceKeyPair

    identity = install.StateDir(state).load_identity()
    keys = DeviceKeyPair.from_private(identity.private_keyset)
    return lambda wrapped, uid: keys.unwrap(wrapped, device_id=identity.device_id, version_uid=uid)


def test_a_full_disk_fails_the_install_cleanly_and_it_is_tried_again(cp, tmp_path, monkeypatch):
    version, digest, _ = push_big(cp, tmp_path)
    state = tmp_path / "s"
    rollout(cp, 1)
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    rollout(cp, version)
    real, written = download.write_all, [0]

    def filling(fd: int, data: bytes) -> None:
        written[0] += len(data)
        if written[0] > SEGMENT_SIZE:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(download, "write_all", filling)
    outcome = asyncio.run(once(cp, state))
    (failed,) = outcome.installs
    assert failed.result == "failed" and "disk full" in failed.reason
    # Nothing half-installed: no partial file holding the space, v1 still active.
    assert not (state / "artifacts" / f"{digest}.part").exists()
    assert not (state / "artifacts" / digest).exists()
    model = status(state)["models"][MODEL]
    assert model["active"]["version"] == 1 and "disk full" in model["failed"]["reason"]
    monkeypatch.setattr(download, "write_all", real)
    assert asyncio.run(once(cp, state)).converged  # space back: the next sync installs it
