"""The device agent: promote-to-serving time, idle cost, local API overhead.

One control plane (embedded default) and one real agent process (`skiff agent run`) on
this machine. Reported:

* `promote_to_serving_vs_raw`: from creating the rollout of v2 (a model of `--mb` MB) to
  the agent's local API answering with v2 (download, digest check, decrypt, self-test
  against golden data on the config v1 won with, atomic activation, hot swap), divided by
  the raw time to copy the same ciphertext on this disk and decrypt it in memory
  (what any installer must do at least), measured in the same run. Aim: <= 3.
  `probe_after_promote_s`: how long the agent then probed the other configs while v2
  served; nothing else is measured until it is done (it takes the CPU).
* `idle_cpu_percent`: the agent's CPU over `--idle` seconds with its Watch stream open
  and nothing to do (utime + stime from /proc). Aim: < 0.5.
* `idle_rss_mb`: its resident memory then, no model loaded. Aim: <= 60. The agent runs
  as a device runs it, `python -m device_agent agent run` (the `skiff` console script),
  not through the operator's command line, which imports the control plane's modules.
  This first run enrolled: it made its key pair, with Tink (about 13 MB resident).
  `idle_rss_restarted_mb`: the same, the agent stopped and started again with its
  identity, as after every later boot (no Tink until a version is to be installed).
* `local_api_overhead_us`: median `Infer` latency through the Unix-socket API (a gRPC
  client in this process) minus the median in-process `runtime.Model.run` on the same
  (small) model: the price of the socket, protobuf and the worker process.
* `local_api_floor_us`: the IPC floor under that: the median of a bare gRPC unary echo
  (an asyncio gRPC server in a process of its own, as the agent's is, handing the request
  bytes back) over a Unix socket, from the same kind of client, with the same
  `InferRequest` serialized on the way out and parsed on the way back; measured in
  blocks interleaved with the Infer calls. `local_api_over_floor_us` is Infer minus it:
  what the agent adds (parsing, checks, the worker round trip, the run itself).
* `worker_run_p50_us`: the second floor, the worker hop: `runtime.Model.run` through a
  worker process (as the agent runs every model), from this process, on the config the
  agent serves with; `in_process_run_p50_us` is then measured on that config too, in
  blocks interleaved with it. `local_api_over_floors_us` is Infer less the echo and the
  worker's run: what the agent's own handling costs (the request's conversion and
  checks, the counting, the event loop's wait for the worker's reply).
* `pipeline_events_per_s`: shopping events (`control_plane/demo/sample_pipeline.py`, about
  one in thirteen fires the trigger) pushed through `PushEvents` in batches of 1000 until
  every firing's model result reached a `Subscribe` stream in this process.
  `pipeline_vs_in_process` divides it by the events per second of the same pipeline
  and model run in one process (`runtime.pipeline.Pipeline` + an in-process
  `runtime.Model`, one run per firing): what an app embedding the runtime would get.
  `pipeline_batched_events_per_s` and `pipeline_batched_vs_in_process`: the same with the
  results read through `SubscribeBatches` (a message per batch, not per result), the
  same events an hour later; `pipeline_columns_events_per_s` and
  `pipeline_columns_vs_in_process`: that, with the events pushed as `EventColumns` (no
  message per event), an hour later again.

    python bench/agent.py            # 100 MB model, 60 s idle
    python bench/agent.py --quick    # 10 MB model, 10 s idle; under a minute

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402
import numpy as np  # noqa: E402
from _agent_pipeline import pipeline_figures  # noqa: E402
from propagation import start_servers, stop_servers  # noqa: E402

from contract.chunks import ChunkTable, unpack_keys  # noqa: E402
from contract.key_wrap import DeviceKeyPair  # noqa: E402
from control_plane.api.client import AdminClient  # noqa: E402
from control_plane.api.transport import client_tls  # noqa: E402
from control_plane.demo import sample_models  # noqa: E402
from control_plane.demo.sample_pipeline import (  # noqa: E402
    activity_pipeline,
)
from control_plane.home import read_token  # noqa: E402
from control_plane.settings import load_config  # noqa: E402
from device_agent.chunk_store import ChunkStore  # noqa: E402
from device_agent.install import decrypt_artifact  # noqa: E402
from device_agent.local_api import socket_path, to_tensor  # noqa: E402
from device_agent.plaintext import from_chunks  # noqa: E402
from device_agent.state import StateDir  # noqa: E402
from protos import agent_pb2, agent_pb2_grpc, fleet_pb2  # noqa: E402

BIG, SMALL = "big", "small"
# What a device runs: the `skiff` console script (device_agent.cli:main), which never
# imports the control plane's command line (nor what that imports, numpy included).
AGENT = [sys.executable, "-m", "device_agent"]
TICKS = os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def push(client: AdminClient, tmp: Path, name: str, seed: int, size: int, pipeline=None) -> None:
    path = tmp / f"{name}-{seed}.onnx"
    with open(path, "wb") as f:
        if size:
            sample_models.write_sized_mlp_onnx(f.fileno(), size, seed=seed)
        else:
            f.write(sample_models.tiny_mlp_onnx(seed=seed))
    client.push(path, name=name, pipeline=pipeline)
    path.unlink()


def wait_serving(stub, name: str, x: np.ndarray, version: int, timeout: float = 600) -> float:
    """Poll Infer until `version` answers; return when it did (monotonic)."""
    deadline = time.monotonic() + timeout
    request = agent_pb2.InferRequest(model=name, inputs=[to_tensor("x", x)])
    while time.monotonic() < deadline:
        try:
            if stub.Infer(request, timeout=30).version == version:
                return time.monotonic()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise
        time.sleep(0.02)
    raise RuntimeError(f"{name} v{version} never served")


def wait_probed(state: Path, name: str, timeout: float = 600) -> float:
    """Wait until the probe the agent runs after a promote (while serving) has ended.

    Return the seconds waited. Nothing else is measured meanwhile: it takes the CPU.
    """
    start = time.monotonic()
    pointer = StateDir(state).models / f"{name}.json"
    while json.loads(pointer.read_text())["active"].get("probes_pending"):
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"{name}: the probe after the promote never ended")
        time.sleep(0.05)
    return time.monotonic() - start


def raw_copy_and_decrypt(state: Path, name: str, scratch: Path) -> float:
    """Copy the installed ciphertext on this disk and decrypt it in memory; return seconds."""
    s = StateDir(state)
    identity = s.load_identity()
    slot = json.loads((s.models / f"{name}.json").read_text())["active"]
    keys = DeviceKeyPair.from_private(identity.private_keyset)
    key = keys.unwrap(
        base64.b64decode(slot["wrapped_data_key"]),
        device_id=identity.device_id,
        version_uid=slot["uid"],
    )
    if slot.get("chunks"):
        return _raw_copy_and_decrypt_chunks(s, name, slot, key, scratch)
    source = s.artifacts / slot["artifact"]
    best = float("inf")
    for _ in range(3):
        copy = scratch / "copy"
        start = time.perf_counter()
        shutil.copyfile(source, copy)
        with open(copy, "rb+") as f:
            os.fsync(f.fileno())
        plain = decrypt_artifact(
            copy,
            key,
            slot["associated_data"].encode(),
            slot["plaintext_sha256"],
            slot["plaintext_size"],
        )
        best = min(best, time.perf_counter() - start)
        del plain
        copy.unlink()
    return best


def _raw_copy_and_decrypt_chunks(s: StateDir, name: str, slot: dict, key, scratch: Path) -> float:
    """The same for a version installed as chunks: copy its chunks, open them in order."""
    table = ChunkTable.from_manifest(slot["chunks"]["table"], slot["plaintext_size"])
    ref = slot["chunks"]["keys"]
    best = float("inf")
    for _ in range(3):
        copies = scratch / "chunks"
        copies.mkdir()
        start = time.perf_counter()
        for chunk in table.distinct():
            shutil.copyfile(s.chunks / chunk.hex(), copies / chunk.hex())
        fd = os.open(copies, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        packed = decrypt_artifact(
            s.artifacts / ref["artifact"],
            key,
            ref["associated_data"].encode(),
            ref["plaintext_sha256"],
            ref["plaintext_size"],
        )
        keys = unpack_keys(packed, table)
        plain = from_chunks(
            ChunkStore(copies), table, keys, name, slot["plaintext_sha256"], slot["plaintext_size"]
        ).read()
        best = min(best, time.perf_counter() - start)
        del plain
        shutil.rmtree(copies)
    return best


def run_us(data_path: Path, x: np.ndarray, config: str, runs: int) -> dict[str, float]:
    """Median `runtime.Model.run` in process and through a worker (us), on `config`.

    The worker's round trip (a frame each way over a socketpair to a process of its own)
    is the second floor under the local API: the agent runs every model in a worker.
    Measured in interleaved blocks, as the gRPC figures are.
    """
    from runtime import Model

    data = data_path.read_bytes()
    times: dict[str, list[float]] = {"in_process": [], "worker": []}
    with (
        Model.from_bytes(data, config=config, isolation="in_process") as local,
        Model.from_bytes(data, config=config, isolation="worker") as worker,
    ):
        models = {"in_process": local, "worker": worker}
        for model in models.values():
            for _ in range(50):
                model.run({"x": x})
        block = 50
        for _ in range(max(1, runs // block)):
            for name, model in models.items():
                for _ in range(block):
                    start = time.perf_counter_ns()
                    model.run({"x": x})
                    times[name].append((time.perf_counter_ns() - start) / 1000)
    return {name: statistics.median(t) for name, t in times.items()}


ECHO = "/skiff.bench.Echo/Echo"


def echo_server(path: str) -> None:
    """Serve a bare unary echo on a Unix socket until killed (the floor's server)."""
    import asyncio

    from device_agent.local_api import SERVER_OPTIONS

    async def serve() -> None:
        server = grpc.aio.server(options=SERVER_OPTIONS)

        async def echo(request: bytes, context) -> bytes:
            return request

        handler = grpc.unary_unary_rpc_method_handler(echo)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("skiff.bench.Echo", {"Echo": handler}),)
        )
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def infer_and_floor_us(stub, request, tmp: Path, runs: int) -> tuple[float, float]:
    """Median Infer and bare-echo latencies (us), in interleaved blocks of calls."""
    path = tmp / "echo.sock"
    server = subprocess.Popen([sys.executable, __file__, "--echo-server", str(path)])
    try:
        while not path.exists():
            if server.poll() is not None:
                raise RuntimeError("the echo server did not start")
            time.sleep(0.05)
        channel = grpc.insecure_channel(f"unix:{path}")
        echo = channel.unary_unary(
            ECHO,
            request_serializer=agent_pb2.InferRequest.SerializeToString,
            response_deserializer=agent_pb2.InferRequest.FromString,
        )
        calls = {
            "infer": lambda: stub.Infer(request, timeout=30),
            "echo": lambda: echo(request, timeout=30),
        }
        times: dict[str, list[float]] = {"infer": [], "echo": []}
        for call in calls.values():  # warm up both
            for _ in range(50):
                call()
        block = 50
        for _ in range(max(1, runs // block)):
            for name, call in calls.items():
                for _ in range(block):
                    t = time.perf_counter_ns()
                    call()
                    times[name].append((time.perf_counter_ns() - t) / 1000)
        channel.close()
        return statistics.median(times["infer"]), statistics.median(times["echo"])
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--echo-server", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="10 MB model, 10 s idle")
    parser.add_argument("--mb", type=int, default=0, help="size of the big model in MB")
    parser.add_argument("--idle", type=float, default=0, help="seconds of idle to measure")
    args = parser.parse_args()
    if args.echo_server:
        echo_server(args.echo_server)
        return
    mb = args.mb or (10 if args.quick else 100)
    idle_s = args.idle or (10.0 if args.quick else 60.0)
    results: dict = {"model_mb": mb, "idle_s": idle_s, "cores": os.cpu_count()}
    with tempfile.TemporaryDirectory(prefix="skiff-bench-agent-") as tmp_name:
        tmp = Path(tmp_name)
        home, state = tmp / "home", tmp / "s"
        servers = start_servers(home, 1)
        agent = None
        try:
            address = servers[0][1]
            config = load_config(home, environ={})
            tls = client_tls(config)
            client = AdminClient(address, read_token(home), tls)
            print(f"pushing {SMALL} and {BIG} ({mb} MB) v1 and v2 ...", flush=True)
            push(client, tmp, SMALL, 1, 0)
            push(client, tmp, SMALL, 2, 0, pipeline=activity_pipeline())
            push(client, tmp, BIG, 1, mb << 20)
            push(client, tmp, BIG, 2, mb << 20)
            token = client.create_enrollment_token(uses=1).token

            def start_agent(**env: str) -> subprocess.Popen:
                agent = subprocess.Popen(
                    [*AGENT, "agent", "run", "--server", address, "--state", str(state)]
                    # The pipeline's throughput, not the bounds that keep an app from
                    # flooding the device: lifted far above what this machine can push.
                    + ["--push-events-per-s", "1e8", "--pipeline-runs-per-s", "1e7"]
                    + ["--ca", str(home / "tls" / "ca.pem"), "--report-interval", "3600"],
                    env={**os.environ, **env},
                    stderr=(tmp / "agent.log").open("a"),
                )
                while not socket_path(state).exists():
                    if agent.poll() is not None:
                        raise RuntimeError((tmp / "agent.log").read_text())
                    time.sleep(0.1)
                time.sleep(2)  # enrolled, first Sync done, Watch open
                return agent

            agent = start_agent(SKIFF_ENROLL_TOKEN=token)
            cpu0, t0 = cpu_s(agent.pid), time.monotonic()
            time.sleep(idle_s)
            cpu = cpu_s(agent.pid) - cpu0
            results["idle_cpu_percent"] = round(100 * cpu / (time.monotonic() - t0), 3)
            results["idle_rss_mb"] = round(rss_mb(agent.pid), 1)
            # As after every boot but the first: the agent started with its identity (it
            # made no key pair, so it holds no Tink until a version is installed).
            agent.send_signal(signal.SIGTERM)
            agent.wait(timeout=60)
            agent = start_agent()
            time.sleep(min(idle_s, 5.0))
            results["idle_rss_restarted_mb"] = round(rss_mb(agent.pid), 1)
            print(
                f"idle {idle_s:.0f} s, Watch open, no model: CPU {results['idle_cpu_percent']}%"
                f" (aim < 0.5), RSS {results['idle_rss_mb']} MB (aim <= 60); restarted "
                f"(enrolled before): RSS {results['idle_rss_restarted_mb']} MB",
                flush=True,
            )

            stub = agent_pb2_grpc.AgentServiceStub(
                grpc.insecure_channel(f"unix:{socket_path(state)}")
            )
            width = sample_models._sized_dims(mb << 20)[0]
            big_x = np.ones((1, width), np.float32)
            client.create_rollout(fleet_pb2.CreateRolloutRequest(model=BIG, version=1))
            wait_serving(stub, BIG, big_x, 1)
            start = time.monotonic()
            client.create_rollout(fleet_pb2.CreateRolloutRequest(model=BIG, version=2))
            serving = wait_serving(stub, BIG, big_x, 2) - start
            results["probe_after_promote_s"] = round(wait_probed(state, BIG), 3)
            raw = raw_copy_and_decrypt(state, BIG, tmp)
            results["promote_to_serving_s"] = round(serving, 3)
            results["raw_copy_decrypt_s"] = round(raw, 3)
            results["promote_to_serving_vs_raw"] = round(serving / raw, 2)
            print(
                f"{mb} MB: rollout to v2 serving {serving:.2f} s; raw copy + decrypt "
                f"{raw:.2f} s: ratio {serving / raw:.2f} (aim <= 3)",
                flush=True,
            )

            small_x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)
            client.create_rollout(fleet_pb2.CreateRolloutRequest(model=SMALL, version=1))
            wait_serving(stub, SMALL, small_x, 1)
            request = agent_pb2.InferRequest(model=SMALL, inputs=[to_tensor("x", small_x)])
            runs = 300 if args.quick else 2000
            config = stub.Infer(request, timeout=30).config  # what the agent's probe chose
            api_us, floor_us = infer_and_floor_us(stub, request, tmp, runs)
            mnn = tmp / "small.mnn"
            mnn.write_bytes(sample_models.onnx_to_mnn_bytes(sample_models.tiny_mlp_onnx(seed=1)))
            run = run_us(mnn, small_x, config, runs)
            local_us, worker_us = run["in_process"], run["worker"]
            # Floors under Infer, each measured: the gRPC hop (bare echo), the worker hop
            # (a worker's run less an in-process run), the run itself. The rest is the agent.
            floors_us = floor_us + worker_us
            results["local_api_infer_p50_us"] = round(api_us, 1)
            results["in_process_run_p50_us"] = round(local_us, 1)
            results["worker_run_p50_us"] = round(worker_us, 1)
            results["local_api_overhead_us"] = round(api_us - local_us, 1)
            results["local_api_floor_us"] = round(floor_us, 1)
            results["local_api_over_floor_us"] = round(api_us - floor_us, 1)
            results["local_api_over_floors_us"] = round(api_us - floors_us, 1)
            print(
                f"Infer through the local API p50 {api_us:.0f} us; in-process run p50 "
                f"{local_us:.0f} us ({config}): overhead {api_us - local_us:.0f} us; bare gRPC "
                f"echo over a Unix socket p50 {floor_us:.0f} us: Infer is "
                f"{api_us - floor_us:.0f} us above that floor; a run through a worker p50 "
                f"{worker_us:.0f} us (its hop {worker_us - local_us:.0f} us): the agent adds "
                f"{api_us - floors_us:.0f} us above both floors and the run",
                flush=True,
            )
            client.create_rollout(fleet_pb2.CreateRolloutRequest(model=SMALL, version=2))
            wait_serving(stub, SMALL, small_x, 2)
            wait_probed(state, SMALL)  # v2's probe of the other configs would share the CPU
            results.update(pipeline_figures(stub, SMALL, tmp, 20_000 if args.quick else 100_000))
            client.close()
        finally:
            if agent is not None:
                agent.send_signal(signal.SIGTERM)
                agent.wait(timeout=60)
            stop_servers(servers)
    results["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(f"reproduce: {results['command']}")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
