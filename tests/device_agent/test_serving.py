"""The agent as a daemon: serve installed models locally, hot-swap, fall back, report."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from device_agent.local_api import socket_path, to_array, to_tensor
from protos import agent_pb2, agent_pb2_grpc
from runtime.npz import read_npz, write_npz
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_agent import SKIFF, agent, rollout, token

X = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)


def start_daemon(cp, state, *extra: str, cpus: set[int] | None = None) -> subprocess.Popen:
    """Start `skiff agent run`; with `cpus`, on those CPUs only (a smaller device)."""
    ca = cp.config.home / "tls" / "ca.pem"
    return subprocess.Popen(
        [*SKIFF, "agent", "run", "--server", f"127.0.0.1:{cp.port}", "--ca", str(ca)]
        + ["--state", str(state), "--enroll-token", token(cp), "--json-log"]
        + ["--report-interval", "1", *extra],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )


def stop_daemon(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    return stderr


def stub(state) -> agent_pb2_grpc.AgentServiceStub:
    channel = grpc.insecure_channel(f"unix:{socket_path(state)}")
    return agent_pb2_grpc.AgentServiceStub(channel)


def infer(state, x=X, model=MODEL, timeout=30) -> agent_pb2.InferResponse:
    return stub(state).Infer(
        agent_pb2.InferRequest(model=model, inputs=[to_tensor("x", x)]), timeout=timeout
    )


def wait_serving(state, version: int, proc, timeout: float = 90) -> agent_pb2.InferResponse:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        try:
            reply = infer(state)
            if reply.version == version:
                return reply
            last = f"serving v{reply.version}"
        except grpc.RpcError as exc:
            last = f"{exc.code().name}: {exc.details()}"
            assert exc.code() != grpc.StatusCode.INVALID_ARGUMENT, last
        time.sleep(0.2)
    raise AssertionError(f"v{version} never served ({last})")


def device_id(state) -> str:
    return json.loads((state / "identity.json").read_text())["device_id"]


def fleet_show(cp, device: str) -> dict:
    """What `skiff fleet show DEVICE --json` prints (its text form is checked to render)."""
    from control_plane.cli import fleet_views

    with cp.client() as client:
        found = client.get_device(device)
    assert found.id in fleet_views.device_text(found)
    return fleet_views.device_dict(found, telemetry=True)


def test_serves_hot_swaps_without_failing_a_request_and_reports(cp, tmp_path):
    state = tmp_path / "s"
    proc = start_daemon(cp, state)
    try:
        deadline = time.monotonic() + 60
        while not socket_path(state).exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        # It will hold plaintext models in memory: no core dump, from before the first.
        limits = (Path("/proc") / str(proc.pid) / "limits").read_text()
        assert re.search(r"Max core file size\s+0\s+0", limits), limits
        rollout(cp, 1)
        first = wait_serving(state, 1, proc)
        assert stat.S_IMODE(os.stat(socket_path(state)).st_mode) == 0o660
        assert first.config and first.latency_us > 0
        assert to_array(first.outputs[0]).shape == (1, 4)

        # Requests run back to back while v2 installs and swaps in: none may fail.
        failures, versions, stop = [], set(), threading.Event()

        def hammer():
            s = stub(state)
            while not stop.is_set():
                try:
                    versions.add(
                        s.Infer(
                            agent_pb2.InferRequest(model=MODEL, inputs=[to_tensor("x", X)]),
                            timeout=30,
                        ).version
                    )
                except grpc.RpcError as exc:
                    failures.append(f"{exc.code().name}: {exc.details()}")

        threads = [threading.Thread(target=hammer) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            rollout(cp, 2)
            wait_serving(state, 2, proc)
            time.sleep(0.5)
        finally:
            stop.set()
            for t in threads:
                t.join()
        assert not failures, failures[:3]
        assert versions == {1, 2}

        # `skiff infer` through the agent, to a file and as JSON.
        inputs, out = tmp_path / "in.npz", tmp_path / "out.npz"
        inputs.write_bytes(write_npz({"x": X}))
        done = subprocess.run(
            [*SKIFF, "infer", "--state", str(state), MODEL, "--input", str(inputs)]
            + ["-o", str(out), "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        (name,) = body["outputs"]
        assert body["version"] == 2 and body["outputs"][name]["shape"] == [1, 4]
        got = read_npz(out.read_bytes(), "out", 1 << 20)[name]
        np.testing.assert_array_equal(got, to_array(infer(state).outputs[0]))

        # Telemetry reaches the control plane: installs and per-model latency.
        device = device_id(state)
        deadline = time.monotonic() + 30
        while True:
            shown = fleet_show(cp, device)
            ran = {(x["version"], x["inferences"] > 0) for x in shown["latency"]}
            if (2, True) in ran or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert (2, True) in ran, shown
        v2 = next(x for x in shown["latency"] if x["version"] == 2)
        assert v2["p50_us"] > 0 and v2["p99_us"] >= v2["p50_us"] and v2["errors"] == 0
        results = [(i["version"], i["result"]) for i in shown["recent_installs"]]
        assert results[:2] == [(2, "activated"), (1, "activated")]
        assert shown["recent_installs"][0]["timings"]["self_test_s"] > 0
        status = stub(state).Status(agent_pb2.StatusRequest(), timeout=10)
        assert status.device_id == device and status.server_reachable
        assert status.models[0].active_version == 2 and status.models[0].previous_version == 1
        assert status.models[0].serving and status.models[0].inferences > 0
    finally:
        stderr = stop_daemon(proc)
    assert json.loads(stderr.strip().splitlines()[-1])["message"] == "stopped"
    assert not socket_path(state).exists() or not status_running(state)


def status_running(state) -> bool:
    out = subprocess.run(
        [*SKIFF, "agent", "status", "--state", str(state), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout)["running"]


def test_malformed_local_requests_get_clear_errors_and_the_agent_stays_up(cp, tmp_path):
    state = tmp_path / "s"
    rollout(cp, 1)
    proc = start_daemon(cp, state)
    try:
        wait_serving(state, 1, proc)
        s = stub(state)
        good = to_tensor("x", X)
        cases = {
            "dtype 'complex64' is not one of": agent_pb2.Tensor(
                name="x", dtype="complex64", shape=[1, 16], data=bytes(128)
            ),
            "do not hold shape": agent_pb2.Tensor(
                name="x", dtype="float32", shape=[1, 16], data=bytes(10)
            ),
            "is not a valid shape": agent_pb2.Tensor(
                name="x", dtype="float32", shape=[-1, 16], data=bytes(64)
            ),
            "object": agent_pb2.Tensor(name="x", dtype="object", shape=[1], data=bytes(8)),
            "is too large": agent_pb2.Tensor(
                name="x", dtype="float32", shape=[0, 2**62, 2**62], data=b""
            ),
        }
        for expected, tensor in cases.items():
            with pytest.raises(grpc.RpcError) as info:
                s.Infer(agent_pb2.InferRequest(model=MODEL, inputs=[tensor]), timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert expected in info.value.details() or "not one of" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # twice the same input
            s.Infer(agent_pb2.InferRequest(model=MODEL, inputs=[good, good]), timeout=10)
        assert "given twice" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:  # the model's own check: wrong shape
            s.Infer(
                agent_pb2.InferRequest(model=MODEL, inputs=[to_tensor("x", X[:, :8])]),
                timeout=10,
            )
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as info:
            s.Infer(agent_pb2.InferRequest(model="nope", inputs=[good]), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
        assert "not installed" in info.value.details()
        nan = np.full((1, 16), np.nan, dtype=np.float32)
        with pytest.raises(grpc.RpcError) as info:
            s.Infer(agent_pb2.InferRequest(model=MODEL, inputs=[to_tensor("x", nan)]))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # `skiff infer` says the same in one line, with an exit code.
        bad = tmp_path / "bad.npz"
        bad.write_bytes(write_npz({"x": X[:, :8]}))
        done = subprocess.run(
            [*SKIFF, "infer", "--state", str(state), MODEL, "--input", str(bad)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 3 and done.stderr.count("\n") == 1, done.stderr
        assert infer(state).version == 1  # still up, still serving
    finally:
        stop_daemon(proc)


def test_infer_without_a_running_agent_says_so(tmp_path):
    state = tmp_path / "s"
    state.mkdir()
    inputs = tmp_path / "in.npz"
    inputs.write_bytes(write_npz({"x": X}))
    done = subprocess.run(
        [*SKIFF, "infer", "--state", str(state), MODEL, "--input", str(inputs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 6 and "no agent is serving" in done.stderr, done.stderr
    inputs.write_bytes(b"not a zip")
    (state / "agent.sock").touch()
    done = subprocess.run(
        [*SKIFF, "infer", "--state", str(state), MODEL, "--input", str(inputs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3 and "is not a valid .npz" in done.stderr, done.stderr


def test_a_version_crashing_at_run_time_rolls_back_to_the_previous(cp, tmp_path):
    """Real worker crashes (SIGSEGV in the MNN worker) on v2: the agent goes back to v1."""
    from runtime import Model
    from runtime.worker import Fault

    state = tmp_path / "s"
    rollout(cp, 1)

    async def main():
        async with agent(cp, state, enroll_token=token(cp), serve=True) as a:
            await a.sync_once()
            rollout(cp, 2)
            outcome = await a.sync_once()
            assert [o.result for o in outcome.installs] == ["activated"]
            stop = asyncio.Event()
            runner = asyncio.create_task(a.run(stop))
            deadline = time.monotonic() + 60
            while (a.serving.serving(MODEL) or {}).get("version") != 2:  # loaded at start
                assert time.monotonic() < deadline
                await asyncio.sleep(0.1)
            # v2 serves; make its worker segfault on every request from now on.
            slot = a.installer.pointer(MODEL)["active"]
            crashing = Model.from_bytes(
                _plain(a, slot),
                config=slot["config"],
                isolation="worker",
                version=f"{MODEL}:2",
                _fault=Fault("segv"),
            )
            a.serving.put(MODEL, slot, crashing)
            try:
                codes = []
                for _ in range(6):
                    try:
                        reply = await asyncio.to_thread(infer, state)
                        codes.append(reply.version)
                    except grpc.RpcError as exc:
                        codes.append(exc.code().name)
                    if codes[-1] == 1:
                        break
                    await asyncio.sleep(0.2)
                deadline = time.monotonic() + 60
                while (a.serving.serving(MODEL) or {}).get("version") != 1:
                    assert time.monotonic() < deadline, codes
                    await asyncio.sleep(0.2)
                assert codes[:3] == ["UNAVAILABLE"] * 3, codes
                reply = await asyncio.to_thread(infer, state)
                assert reply.version == 1
                pointer = a.installer.pointer(MODEL)
                assert pointer["active"]["version"] == 1
                # A late failure report about v2 (no longer active) changes nothing.
                await a._roll_back(MODEL, slot["uid"], "late report")
                assert a.installer.pointer(MODEL) == pointer
                assert pointer["failed"]["version"] == 2 and pointer["failed"]["kind"] == "runtime"
                # The next sync does not install v2 again: it failed deterministically.
                again = await a.sync_once()
                assert [o.result for o in again.installs] == ["failed"]
                assert not again.converged
                await a.flush_reports()
            finally:
                stop.set()
                await runner

    asyncio.run(main())
    shown = fleet_show(cp, device_id(state))
    results = [(i["version"], i["result"]) for i in shown["recent_installs"]]
    assert (2, "rolled_back") in results and results[0] == (1, "activated"), results
    assert "crashed 3 times in a row" in next(
        i["reason"] for i in shown["recent_installs"] if i["result"] == "rolled_back"
    )
    with cp.client() as client:
        listed = [client.get_rollout(r.id) for r in client.list_rollouts(model=MODEL)]
    counts = {r.version: r.counts for r in listed}
    assert counts[2].failed == 1 and counts[1].installed == 1


def _plain(a, slot) -> bytes:
    import base64

    from device_agent.install import decrypt_artifact

    key = a._unwrap(base64.b64decode(slot["wrapped_data_key"]), slot["uid"])
    return decrypt_artifact(
        a.installer.artifact_path(slot["artifact"]),
        key,
        slot["associated_data"].encode(),
        slot["plaintext_sha256"],
        slot["plaintext_size"],
    )


def test_status_reads_the_state_directory_off_the_loop_once_for_callers_at_once(
    cp, tmp_path, monkeypatch
):
    """Status reads files and probes a lock in a thread of its own, the loop serving
    meanwhile; calls that arrive during a read share it, and one caller leaving ends none.
    """
    from device_agent import status as status_module

    real = status_module.read_status
    entered, release = threading.Event(), threading.Event()
    reads: list[str] = []

    def held(path):
        reads.append(threading.current_thread().name)
        entered.set()
        assert release.wait(10), "the state directory was read on the event loop"
        return real(path)

    monkeypatch.setattr(status_module, "read_status", held)
    rollout(cp, 1)

    async def main():
        async with agent(cp, tmp_path / "s", enroll_token=token(cp), serve=True) as a:
            await a.sync_once()
            first = asyncio.ensure_future(a.status())
            # Waited for from another thread: were the read on the loop, the loop would be
            # stuck in it until `held` gave up.
            assert await asyncio.to_thread(entered.wait, 10)
            others = [asyncio.ensure_future(a.status()) for _ in range(50)]
            await asyncio.sleep(0)  # the loop runs them while the read is held
            assert not first.done() and not any(o.done() for o in others)
            first.cancel()  # a caller that leaves
            release.set()
            answers = await asyncio.gather(*others)
            assert reads[0].startswith("skiff-status") and len(reads) == 1
            assert {s.device_id for s in answers} == {a.identity.device_id}
            assert answers[0].models[0].model == MODEL
            assert answers[0].models[0].active_version == 1
            again = await a.status()  # a call after the read ended reads again
            assert len(reads) == 2 and again == answers[0]

    asyncio.run(main())
