"""Push and pull throughput of the model registry through a real server.

Prints push/pull MB/s for each model size next to this machine's raw single-core
AES-256-GCM and SHA-256 throughput measured in the same run, the ratio of each to the
slower raw figure, the CPU time a pull costs the server and the client (the figure a
shared, loaded machine does not blur), and the server's peak RSS (an upload must
stream, not buffer).
Every push is validated by loading the model with MNN, so the same run also times that
validation alone (`mnn_validate_mb_s_N`): it bounds what a push can reach.
Each figure is the best of a few trials (the machines are shared and noisy).
The last line is one JSON object.

    python bench/registry.py            # 100 MB and 1 GB models
    python bench/registry.py --quick    # 100 MB only, within a minute
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from control_plane.api.client import AdminClient  # noqa: E402
from control_plane.api.transport import client_tls  # noqa: E402
from control_plane.demo import sample_models  # noqa: E402
from control_plane.home import read_token  # noqa: E402
from control_plane.pins import read_pins  # noqa: E402
from control_plane.registry import mnn_tools  # noqa: E402
from control_plane.settings import load_config  # noqa: E402

MB = 1_000_000
CHUNK = 1 << 20


def raw_throughput(total_mb: int) -> dict[str, float]:
    """Single-core AES-256-GCM and SHA-256 over 1 MiB chunks, in MB/s (best of 3)."""
    data = os.urandom(CHUNK)
    rounds = max(1, total_mb * MB // CHUNK)
    aead, nonce = AESGCM(AESGCM.generate_key(bit_length=256)), os.urandom(12)

    def best(fn) -> float:
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return rounds * CHUNK / min(times) / MB

    def aes():
        for _ in range(rounds):
            aead.encrypt(nonce, data, None)

    def sha():
        h = hashlib.sha256()
        for _ in range(rounds):
            h.update(data)

    return {"aes256gcm": best(aes), "sha256": best(sha)}


def validate_throughput(path: Path) -> float:
    """MB/s of MNN validation alone (the child the server runs for every push)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        start = time.perf_counter()
        mnn_tools.inspect_model(fd)
        return path.stat().st_size / (time.perf_counter() - start) / MB
    finally:
        os.close(fd)


def make_model(path: Path, size_mb: int) -> int:
    """Write an .mnn model of about size_mb (converted from ONNX by MNN, off the clock)."""
    src = os.memfd_create("bench-onnx")
    try:
        sample_models.write_sized_mlp_onnx(src, size_mb * MB)
        mnn = mnn_tools.convert_onnx(src)
    finally:
        os.close(src)
    with path.open("wb") as out:
        offset = 0
        while chunk := os.pread(mnn, CHUNK, offset):
            out.write(chunk)
            offset += len(chunk)
    os.close(mnn)
    return path.stat().st_size


def start_server(home: Path) -> tuple[subprocess.Popen, str]:
    cli = [sys.executable, "-m", "control_plane.cli"]
    subprocess.run([*cli, "init", "--home", str(home)], check=True, capture_output=True)
    proc = subprocess.Popen(
        [*cli, "server", "--home", str(home), "--grpc", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    line = proc.stdout.readline()
    return proc, line.split("listening on ")[1].split()[0]


def peak_rss_mb(pid: int) -> float:
    """VmHWM of one process: its own peak resident set, not its MNN children's."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / MB
    raise RuntimeError("no VmHWM")


def cpu_ms(server_pid: int) -> tuple[float, float]:
    """CPU time used so far by the server process and by this one (all threads), in ms."""
    fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
    server = (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")
    own = resource.getrusage(resource.RUSAGE_SELF)
    return server, (own.ru_utime + own.ru_stime) * 1000


def measure(
    client: AdminClient, server_pid: int, tmp: Path, size_mb: int, trials: int, slower: float
) -> dict:
    """Push and pull one model size `trials` times; best MB/s of each, CPU ms of a pull."""
    model, out = tmp / f"model-{size_mb}.mnn", tmp / "pulled.mnn"
    nbytes = make_model(model, size_mb)
    validate = max(validate_throughput(model) for _ in range(trials))
    push_s, pull_s, pull_cpu = [], [], []
    for _ in range(trials):
        start = time.perf_counter()
        version = client.push(model, name=f"bench-{size_mb}", allow_duplicate=True)
        push_s.append(time.perf_counter() - start)
        cpu_before = cpu_ms(server_pid)
        start = time.perf_counter()
        client.pull(version.model, version.version, out, pins=read_pins(tmp / "home"))
        pull_s.append(time.perf_counter() - start)
        server_after, client_after = cpu_ms(server_pid)
        pull_cpu.append((server_after - cpu_before[0], client_after - cpu_before[1]))
        assert out.stat().st_size == nbytes
    model.unlink()
    out.unlink()
    push, pull = nbytes / min(push_s) / MB, nbytes / min(pull_s) / MB
    # CPU time is what a loaded machine cannot hide: the median pull's, both sides.
    server_cpu = statistics.median(c[0] for c in pull_cpu)
    client_cpu = statistics.median(c[1] for c in pull_cpu)
    print(
        f"{nbytes / MB:,.0f} MB model: push {push:,.0f} MB/s ({push / slower:.2f}x raw, "
        f"{push / validate:.2f}x MNN validation alone at {validate:,.0f} MB/s), "
        f"pull {pull:,.0f} MB/s ({pull / slower:.2f}x raw; CPU per pull: server "
        f"{server_cpu:,.0f} ms, client {client_cpu:,.0f} ms)",
        flush=True,
    )
    return {
        f"push_mb_s_{size_mb}": round(push, 1),
        f"pull_mb_s_{size_mb}": round(pull, 1),
        f"push_ratio_{size_mb}": round(push / slower, 3),
        f"pull_ratio_{size_mb}": round(pull / slower, 3),
        f"mnn_validate_mb_s_{size_mb}": round(validate, 1),
        f"push_vs_validate_{size_mb}": round(push / validate, 3),
        f"pull_server_cpu_ms_{size_mb}": round(server_cpu, 1),
        f"pull_client_cpu_ms_{size_mb}": round(client_cpu, 1),
    }


def run(sizes: list[int], raw_mb: int, trials: int) -> dict:
    raw = raw_throughput(raw_mb)
    slower = min(raw.values())
    results: dict = {
        "raw_aes256gcm_mb_s": round(raw["aes256gcm"], 1),
        "raw_sha256_mb_s": round(raw["sha256"], 1),
    }
    print(
        f"raw single core: AES-256-GCM {raw['aes256gcm']:,.0f} MB/s, "
        f"SHA-256 {raw['sha256']:,.0f} MB/s",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="skiff-bench-") as tmp:
        tmp = Path(tmp)
        proc, address = start_server(tmp / "home")
        try:
            tls = client_tls(load_config(tmp / "home", environ={}))
            with AdminClient(address, read_token(tmp / "home"), tls) as client:
                for size_mb in sizes:
                    # One trial of the 1 GB model is enough and keeps the run short.
                    n = trials if size_mb < 1000 else 1
                    results.update(measure(client, proc.pid, tmp, size_mb, n, slower))
            results["server_peak_rss_mb"] = round(peak_rss_mb(proc.pid), 1)
            results["largest_model_mb"] = max(sizes)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    print(
        f"server peak RSS {results['server_peak_rss_mb']:,.0f} MB (largest model {max(sizes):,} MB)"
    )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 MB only; under a minute")
    args = parser.parse_args()
    sizes = [100] if args.quick else [100, 1000]
    results = run(sizes, raw_mb=256 if args.quick else 1024, trials=2 if args.quick else 3)
    results["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(f"reproduce: {results['command']}")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
