"""Telemetry ingestion: Report batches per second against a bare gRPC echo, same run.

One control plane (`skiff server`, plaintext on loopback like the echo) on SQLite, then
on PostgreSQL. Simulated devices enroll; each sends Report batches as an agent does
(three models, a latency histogram each, counts, the odd crash: built by
`control_plane.sim.telemetry`, a fresh batch id every call), `--concurrency` calls in
flight, for `--window` seconds. The baseline is the bare echo of bench/sync.py (a
grpc.aio server, raw bytes, no protobuf, no handler work) driven the same way with
messages of the same size. Reported:

* `report_batches_per_s_<db>` and `echo_calls_per_s_<db>`, and their ratio
  `report_vs_echo_<db>` (aim >= 0.3): what storing a batch costs over the transport.
* `health_query_ms` is not measured yet: the rollups it queries are the next part of
  issue 10.

Client, server and database share this machine's two cores.

    python bench/telemetry.py            # 64 devices, 64 in flight, 10 s windows
    python bench/telemetry.py --quick    # 5 s windows, under a minute

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import grpc  # noqa: E402
from sync import pg_database, start_process, stop_process  # noqa: E402

from control_plane.api.client import AdminClient  # noqa: E402
from control_plane.home import read_token  # noqa: E402
from control_plane.sim import FleetSimulator, SimOptions  # noqa: E402
from control_plane.sim.telemetry import Load  # noqa: E402
from device_agent.telemetry import new_batch_id  # noqa: E402

PG_ADMIN = os.environ.get("SKIFF_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
MODELS = {"ctr": (1, "fp32"), "det": (3, "int8"), "asr": (2, "fp16")}
ECHO_PATH = "/skiff.bench.Echo/Echo"


def init_plain_home(home: Path, db_url: str | None) -> None:
    """`skiff init`, then serve plaintext on loopback (as the echo does)."""
    cli = [sys.executable, "-m", "control_plane.cli"]
    subprocess.run(
        [*cli, "init", "--home", str(home), *(["--db", db_url] if db_url else [])],
        check=True,
        capture_output=True,
        cwd=BENCH.parent,
    )
    stored = json.loads((home / "skiff.json").read_text())
    (home / "skiff.json").write_text(
        json.dumps({k: v for k, v in stored.items() if not k.startswith("tls_")})
    )


async def reports(address: str, token: str, devices: int, concurrency: int, window: float):
    """Send Report batches from `devices` devices; return (batches/s, mean batch bytes)."""
    async with FleetSimulator([address], seed=3, options=SimOptions(concurrency=64)) as sim:
        await sim.enroll(devices, token)
        end = dt.datetime.now(dt.UTC)
        prepared = []
        for d in sim.devices:
            load = Load(d.id, d.identity.attributes, sim.seed)
            batch = load.batch(MODELS, end - dt.timedelta(seconds=60), end, [])
            prepared.append((d, batch))
        size = sum(b.ByteSize() for _, b in prepared) / len(prepared)

        async def one(i: int, stop: float, counts: list[int]) -> None:
            device, batch = prepared[i % len(prepared)]
            while time.monotonic() < stop:
                batch.batch_id = new_batch_id()  # each call a new batch, as agents send
                await device._conn.report(batch)
                counts[0] += 1

        return await _timed(one, concurrency, window), size


async def echoes(address: str, size: int, concurrency: int, window: float) -> float:
    """Call the bare echo with `size`-byte messages; return calls/s."""
    payload = os.urandom(size)
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(ECHO_PATH)

        async def one(i: int, stop: float, counts: list[int]) -> None:
            while time.monotonic() < stop:
                await call(payload, timeout=30)
                counts[0] += 1

        return await _timed(one, concurrency, window)


async def _timed(worker, concurrency: int, window: float) -> float:
    warm = [0]
    await asyncio.gather(*(worker(i, time.monotonic() + 1.0, warm) for i in range(concurrency)))
    counts = [0]
    started = time.monotonic()
    await asyncio.gather(*(worker(i, started + window, counts) for i in range(concurrency)))
    return counts[0] / (time.monotonic() - started)


def run_backend(name: str, db_url: str | None, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"skiff-bench-telemetry-{name}-") as tmp_name:
        tmp = Path(tmp_name)
        home, log = tmp / "home", tmp / "server.log"
        init_plain_home(home, db_url)
        cli = [sys.executable, "-m", "control_plane.cli"]
        server, address = start_process(
            [*cli, "server", "--home", str(home), "--grpc", "127.0.0.1:0"], log, "listening on "
        )
        echo = None
        try:
            with AdminClient(address, read_token(home), None) as client:
                token = client.create_enrollment_token(uses=args.devices).token
            rate, size = asyncio.run(
                reports(address, token, args.devices, args.concurrency, args.window)
            )
            echo, echo_address = start_process(
                [sys.executable, str(BENCH / "_echo.py"), "--response-bytes", "16"],
                log,
                "echo listening on ",
            )
            echo_rate = asyncio.run(echoes(echo_address, int(size), args.concurrency, args.window))
        finally:
            if echo is not None:
                stop_process(echo)
            stop_process(server)
    print(
        f"{name}: {rate:,.0f} Report batches/s ({size:.0f} B each, {len(MODELS)} models); "
        f"bare echo {echo_rate:,.0f} calls/s: ratio {rate / echo_rate:.2f} (aim >= 0.3)",
        flush=True,
    )
    return {
        f"report_batches_per_s_{name}": round(rate, 1),
        f"echo_calls_per_s_{name}": round(echo_rate, 1),
        f"report_vs_echo_{name}": round(rate / echo_rate, 3),
        "batch_bytes": round(size),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s windows")
    parser.add_argument("--devices", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--window", type=float, default=0, help="seconds per measurement")
    args = parser.parse_args()
    args.window = args.window or (5.0 if args.quick else 10.0)
    results: dict = {"devices": args.devices, "concurrency": args.concurrency}
    results["window_s"], results["cores"] = args.window, os.cpu_count()
    results.update(run_backend("sqlite", None, args))
    pg_url, drop = pg_database(PG_ADMIN)
    try:
        results.update(run_backend("postgresql", pg_url, args))
    finally:
        drop()
    results["health_query_ms"] = None
    results["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(f"reproduce: {results['command']}")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
