"""The device agent against a real control plane: enroll, sync, verify, install, refuse."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from contract.assignment import AssignmentRejected
from contract.pinned_keys import PinnedKeyRing
from device_agent.agent import Agent
from device_agent.state import AgentError, Identity, StateDir
from protos import fleet_pb2
from tests.device_agent.conftest import MODEL, blob_path

SKIFF = [sys.executable, "-m", "control_plane.cli"]
DEVICE_SKIFF = [sys.executable, "-m", "device_agent"]  # what the `skiff` script runs


def rollout(cp, version: int, selector: str = "") -> fleet_pb2.Rollout:
    with cp.client() as client:
        return client.create_rollout(
            # Often made before the agent enrolls: an empty selection is meant.
            fleet_pb2.CreateRolloutRequest(
                model=MODEL, version=version, selector=selector, allow_empty=True
            )
        )


def token(cp) -> str:
    with cp.client() as client:
        return client.create_enrollment_token(uses=0).token


def agent(cp, state_dir, **kw) -> Agent:
    return Agent(StateDir(state_dir), f"127.0.0.1:{cp.port}", tls=cp.tls, **kw)


async def once(cp, state_dir, **kw):
    async with agent(cp, state_dir, **kw) as a:
        return await a.sync_once()


def run_agent_cli(cp, state_dir, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `skiff agent run --once` against `cp`."""
    ca = cp.config.home / "tls" / "ca.pem"
    return subprocess.run(
        [*SKIFF, "agent", "run", "--server", f"127.0.0.1:{cp.port}", "--ca", str(ca)]
        + ["--state", str(state_dir), "--once", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def status(state_dir) -> dict:
    out = subprocess.run(
        [*SKIFF, "agent", "status", "--state", str(state_dir), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)


def test_once_enrolls_installs_then_reuses_its_identity(cp, tmp_path):
    rollout(cp, 1)
    state = tmp_path / "state"
    first = run_agent_cli(cp, state, "--enroll-token", token(cp), "--attr", "platform=android")
    assert first.returncode == 0, first.stderr
    body = status(state)
    assert body["models"][MODEL]["active"]["version"] == 1
    assert body["models"][MODEL]["active"]["config"]  # picked by probing against golden data
    assert body["attributes"] == {"platform": "android"} and not body["running"]
    # The identity is private to the device: 0700 directory, 0600 files, never printed.
    assert stat.S_IMODE(state.stat().st_mode) == 0o700
    for path in state.rglob("*"):
        if path.is_file():
            assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    identity = json.loads((state / "identity.json").read_text())
    for secret in (identity["credential"], identity["private_keyset"]):
        assert secret not in first.stderr + first.stdout
        assert secret not in json.dumps(body)
    # Artifacts stay encrypted at rest: no file holds the model's plaintext digest's bytes.
    again = run_agent_cli(cp, state)  # no token: the stored identity is used
    assert again.returncode == 0, again.stderr
    assert status(state)["device_id"] == body["device_id"]
    with cp.client() as client:
        assert [d.id for d in client.list_devices()] == [body["device_id"]]


def test_a_second_agent_on_the_same_state_is_refused(cp, tmp_path):
    state = StateDir(tmp_path / "state")
    with state.locked():
        result = run_agent_cli(cp, state.path, "--enroll-token", token(cp))
    assert result.returncode == 7
    assert result.stderr.strip().splitlines() == [
        f"skiff: error: another agent (pid {os.getpid()}) is running on {state.path}"
    ]
    assert not (state.path / "identity.json").exists()


def test_without_identity_or_token_it_says_what_to_do(cp, tmp_path):
    result = run_agent_cli(cp, tmp_path / "state")
    assert result.returncode == 2  # a usage error: the command line lacks --enroll-token
    assert "holds no device identity: pass --enroll-token" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_a_rollout_and_its_rollback_move_the_active_version(cp, tmp_path):
    state = tmp_path / "state"
    rollout(cp, 1)
    assert asyncio.run(once(cp, state, enroll_token=token(cp))).converged
    second = rollout(cp, 2)
    outcome = asyncio.run(once(cp, state))
    assert outcome.converged and [o.result for o in outcome.installs] == ["activated"]
    model = status(state)["models"][MODEL]
    assert (model["active"]["version"], model["previous"]["version"]) == (2, 1)
    with cp.client() as client:
        client.transition_rollout(second.id, "rollback", "")
    outcome = asyncio.run(once(cp, state))
    timings = outcome.installs[0].timings
    assert outcome.converged and timings.downloaded_bytes == 0  # v1 was kept for fallback
    model = status(state)["models"][MODEL]
    assert (model["active"]["version"], model["previous"]["version"]) == (1, 2)


def test_a_flipped_byte_in_the_blob_store_is_refused_and_v1_keeps_serving(cp, tmp_path):
    state = tmp_path / "state"
    rollout(cp, 1)
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    _, [v2] = cp.registry.show(MODEL, 2)
    blob = blob_path(cp, v2.variant("fp32").ciphertext_sha256)
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    rollout(cp, 2)
    outcome = asyncio.run(once(cp, state))
    assert not outcome.converged
    assert "segment 0 does not match its signed digest" in outcome.installs[0].reason
    body = status(state)
    assert body["models"][MODEL]["active"]["version"] == 1
    assert body["models"][MODEL]["failed"]["version"] == 2
    assert "does not match" in body["last_error"]
    assert not list((state / "artifacts").glob("*.part"))  # nothing half-kept
    # --once says so: exit 9, one line naming the version and the reason.
    result = run_agent_cli(cp, state)
    assert result.returncode == 9
    assert "det v2: artifact" in result.stderr.strip().splitlines()[-1]
    # A bad download is not held against the version: once the store is repaired, it installs.
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))
    assert asyncio.run(once(cp, state)).converged
    assert status(state)["models"][MODEL]["active"]["version"] == 2


def test_a_cut_download_without_segment_digests_resumes_at_its_offset(cp, tmp_path, monkeypatch):
    # Versions pushed before manifests signed per-segment digests: the whole file's digest
    # is checked at the end, and a cut download resumes at its last byte.
    # (Segment by segment: tests/device_agent/test_faults.py.)
    import contract.assignment

    monkeypatch.setattr(contract.assignment, "_segments", lambda *a: b"")
    state = tmp_path / "state"
    asyncio.run(once(cp, state, enroll_token=token(cp)))  # enrolled, nothing assigned
    _, [v1] = cp.registry.show(MODEL, 1)
    fp32 = v1.variant("fp32")
    ciphertext = blob_path(cp, fp32.ciphertext_sha256).read_bytes()
    half = len(ciphertext) // 2
    (state / "artifacts" / f"{fp32.ciphertext_sha256}.part").write_bytes(ciphertext[:half])
    rollout(cp, 1)
    outcome = asyncio.run(once(cp, state))
    timings = outcome.installs[0].timings
    assert outcome.converged
    assert (timings.resumed_from, timings.downloaded_bytes) == (half, len(ciphertext) - half)


def test_an_answer_signed_by_another_key_is_refused(cp, tmp_path):
    state_dir = StateDir(tmp_path / "state")
    rollout(cp, 1)
    asyncio.run(once(cp, state_dir.path, enroll_token=token(cp)))
    other = (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    identity = state_dir.load_identity()
    state_dir.save_identity(
        Identity(**{**identity.__dict__, "pinned": PinnedKeyRing.from_pems([other])})
    )
    rollout(cp, 2)
    with pytest.raises(AssignmentRejected):
        asyncio.run(once(cp, state_dir.path))
    body = status(state_dir.path)
    assert body["models"][MODEL]["active"]["version"] == 1 and body["last_error"]


def test_the_daemon_follows_the_watch_stream_and_stops_on_sigterm(cp, tmp_path):
    state = tmp_path / "state"
    ca = cp.config.home / "tls" / "ca.pem"
    asyncio.run(once(cp, state, enroll_token=token(cp)))  # enrolled before, as on every boot
    (state / "sync.json").unlink()  # written again by the daemon's first sync
    proc = subprocess.Popen(  # as a device runs it: not through the operator's commands
        [*DEVICE_SKIFF, "agent", "run", "--server", f"127.0.0.1:{cp.port}", "--ca", str(ca)]
        + ["--state", str(state), "--json-log"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (state / "sync.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        # Synced, Watching, nothing assigned: the daemon holds neither numpy nor Tink (about
        # 30 MB resident together); both come with the first version to install.
        idle = _mapped_packages(proc.pid)
        assert "grpc" in idle and not idle & {"numpy", "numpy.libs", "tink"}, idle
        rollout(cp, 2)  # pushed over Watch: no poll is due for minutes
        while (status(state)["models"].get(MODEL) or {}).get("active") is None:
            assert time.monotonic() < deadline, "the agent never installed v2"
            time.sleep(0.2)
        assert status(state)["running"]
        assert "tink" in _mapped_packages(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.strip().splitlines()]
    assert lines[-1]["message"] == "stopped"
    credential = json.loads((state / "identity.json").read_text())["credential"]
    assert credential not in stderr
    assert not status(state)["running"]


def _mapped_packages(pid: int) -> set[str]:
    """Return the installed packages (site-packages folders) process `pid` maps code from."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    paths = {line.split()[-1] for line in maps if "/site-packages/" in line}
    return {p.split("/site-packages/", 1)[1].split("/", 1)[0] for p in paths}


def _damage_key_set(state) -> Path:
    identity = state / "identity.json"
    body = json.loads(identity.read_text())
    body["private_keyset"] = base64.b64encode(b"\x08\x01not a key set").decode()
    identity.write_text(json.dumps(body))
    return identity


def test_a_damaged_device_key_set_fails_the_install_naming_it_and_the_agent_goes_on(cp, tmp_path):
    """With nothing installed the key pair is read with the first version to install, not
    at start (an idle agent holds no Tink): a damaged one fails each install, reported to
    the control plane in one line, and the next sync tries again."""
    state = tmp_path / "state"
    asyncio.run(once(cp, state, enroll_token=token(cp)))  # enrolled, nothing assigned
    identity = _damage_key_set(state)
    rollout(cp, 1)
    reason = f"{identity}: the device key set is damaged"

    async def scenario() -> None:
        async with agent(cp, state) as a:
            for _ in range(2):  # not given up on: a mended key set installs
                outcome = await a.sync_once()
                assert not outcome.converged
                (install,) = outcome.installs
                assert (install.result, install.reason) == ("failed", reason)
            assert a.installer.active() == {}
            reported = [i for batch in a.outbox.pending() for i in batch.installs]
            assert [(i.result, i.reason) for i in reported] == [("failed", reason)] * 2

    asyncio.run(scenario())
    assert not list((state / "artifacts").glob("*.part"))


def test_a_damaged_device_key_set_with_a_version_installed_fails_the_start(cp, tmp_path):
    """Serving what is installed unwraps its key: the start fails in one line, as it did
    before the key pair was read lazily, never a model 'loading' for ever."""
    state = tmp_path / "state"
    rollout(cp, 1)
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    identity = _damage_key_set(state)
    with pytest.raises(AgentError) as failed:
        asyncio.run(once(cp, state))
    assert str(failed.value) == f"{identity}: the device key set is damaged"
    result = run_agent_cli(cp, state)
    assert result.returncode != 0 and not result.stdout
    assert result.stderr.strip().endswith(f"{identity}: the device key set is damaged")


def test_a_version_failing_its_self_test_is_never_activated(cp, tmp_path, monkeypatch):
    import dataclasses

    import runtime

    state = tmp_path / "state"
    rollout(cp, 1)
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    real = runtime.Golden.from_npz

    def wrong_outputs(data: bytes) -> runtime.Golden:
        # This device's MNN gives outputs other than those recorded at push: every
        # candidate config fails the real probe.
        golden = real(data)
        negated = {name: -(out + 1) for name, out in golden.outputs.items()}
        return dataclasses.replace(golden, outputs=negated)

    monkeypatch.setattr(runtime.Golden, "from_npz", staticmethod(wrong_outputs))
    rollout(cp, 2)
    outcome = asyncio.run(once(cp, state))
    assert not outcome.converged and "self-test failed" in outcome.installs[0].reason
    model = status(state)["models"][MODEL]
    assert model["active"]["version"] == 1 and model["failed"]["version"] == 2
    # Not tried again (the same bytes would fail the same way) until the assignment changes.
    again = asyncio.run(once(cp, state))
    assert again.installs[0].timings.self_test_s == 0.0


def test_a_disk_error_fails_one_sync_and_the_daemon_goes_on(cp, tmp_path):
    state = tmp_path / "state"
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    _, [v1] = cp.registry.show(MODEL, 1)
    part = state / "artifacts" / f"{v1.variant('fp32').ciphertext_sha256}.part"
    part.mkdir()  # the download cannot open its file
    rollout(cp, 1)

    async def scenario() -> None:
        async with agent(cp, state) as a:
            assert await a._try_sync() is False
            assert "state directory error" in a.state.load_sync().last_error
            part.rmdir()
            assert await a._try_sync() is True

    asyncio.run(scenario())


def test_damaged_state_files_are_named_in_one_line(cp, tmp_path):
    state = tmp_path / "state"
    rollout(cp, 1)
    asyncio.run(once(cp, state, enroll_token=token(cp)))
    (state / "models" / "det.old.json").write_text("{}")  # a stray file is ignored
    assert status(state)["models"][MODEL]["active"]["version"] == 1
    pointer = state / "models" / f"{MODEL}.json"
    good = pointer.read_text()
    damaged = {
        pointer: json.dumps({"schema": "skiff.install-pointer/v1", "active": "x"}),
        state / "sync.json": json.dumps({"poll_interval_s": "x"}),
        state / "identity.json": "{not json",
    }
    for path, text in damaged.items():
        saved = path.read_text()
        path.write_text(text)
        result = subprocess.run(
            [*SKIFF, "agent", "status", "--state", str(state)], capture_output=True, text=True
        )
        assert result.returncode == 7, result.stderr
        [line] = result.stderr.strip().splitlines()
        assert line.startswith("skiff: error: ") and str(path) in line
        path.write_text(saved)
    assert pointer.read_text() == good
