"""Telemetry ingestion: Report batches per second against a bare gRPC echo, same run.

One control plane (`skiff server`, plaintext on loopback like the echo) on SQLite, then
on PostgreSQL. Simulated devices enroll; each sends Report batches as an agent does
(three models, a latency histogram each, counts, the odd crash: built by
`control_plane.sim.load`, a fresh batch id every call), `--concurrency` calls in
flight, for `--window` seconds. The baseline is the bare echo of bench/sync.py (a
grpc.aio server, raw bytes, no protobuf, no handler work) driven the same way with
messages of the same size. Report and echo windows alternate for `--rounds` rounds (the
server gets a rollup interval between them to roll what it took in); figures are medians.
Reported:

* `report_batches_per_s_<db>` and `echo_calls_per_s_<db>`, and their ratio
  `report_vs_echo_<db>` (aim >= 0.5): what storing a batch costs over the transport;
  `report_server_cpu_us_<db>` and `echo_server_cpu_us_<db>`: CPU per call of each server
  (steadier than rates on a shared machine).
  `report_batches_per_s`, `report_vs_echo` and `health_query_ms` without a suffix are the
  weaker database's figures.
* `health_query_ms_<db>`: the median time of a rollout's health view (every slice's
  candidate and baseline figures and rule verdicts, each device capped and the outliers
  left out: control_plane.rollouts.guard) over 10k devices: the device rows the roller
  leaves for a rollout that started 30 days ago, sliced by SoC (per device, backend
  config and cohort, for the current stage's window and the one before) (aim <= 200 ms),
  computed as a server process computes it: NumPy's BLAS on one thread
  (control_plane.blas_threads).
* `health_query_late_ms_<db>`: the same view later in such a rollout, at its sixth stage:
  four more stage windows before the current one, and 10k devices outside it reporting
  the same model (the outside cohort's rows): what a view must not read.

Client, server and database share this machine's two cores.

    python bench/telemetry.py            # 1024 devices, 64 in flight, 3 rounds of 10 s windows
    python bench/telemetry.py --quick    # 2 rounds of 5 s windows

The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import grpc  # noqa: E402
from sync import cpu_seconds, pg_database, start_process, stop_process  # noqa: E402

from contract.report_batches import new_batch_id  # noqa: E402
from control_plane.api.client import AdminClient  # noqa: E402
from control_plane.home import read_token  # noqa: E402
from control_plane.sim import FleetSimulator, SimOptions  # noqa: E402
from control_plane.sim.load import Load  # noqa: E402

PG_ADMIN = os.environ.get("SKIFF_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
# What each device reports: published first (the server refuses reports of anything else).
MODELS = {"ctr": (1, "fp32"), "det": (1, "int8"), "asr": (1, "fp16")}
ECHO_PATH = "/skiff.bench.Echo/Echo"
ROLLUP_INTERVAL_S = 5.0  # the server's default (SKIFF_ROLLUP_INTERVAL_S)


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


def publish(client: AdminClient, tmp: Path) -> None:
    """Push MODELS (a tiny model each, with the variant the devices report)."""
    from control_plane.demo import sample_models

    for i, (name, (_, variant)) in enumerate(sorted(MODELS.items())):
        path = tmp / f"{name}.onnx"
        path.write_bytes(sample_models.tiny_mlp_onnx(seed=i))
        variants = () if variant == "fp32" else (variant,)
        client.push(path, name=name, variants=variants, allow_degraded=True)


async def ingestion(
    address: str, echo_address: str, token: str, pids: tuple[int, int], args
) -> tuple[list, float]:
    """Alternate Report and echo windows; return rounds and batch bytes.

    Each round is (batches/s, echo calls/s, server CPU us per batch, echo CPU us per call).
    Between a Report window and the next echo window the server gets a rollup interval to
    roll what it took in, so the echo is timed on a quiet machine and each Report window
    pays for the rolling of its own batches (its CPU per batch counts that rolling too).
    """
    server_pid, echo_pid = pids
    if args.concurrency > args.devices:
        raise SystemExit("--concurrency may not exceed --devices (one caller per device)")
    async with FleetSimulator([address], seed=3, options=SimOptions(concurrency=64)) as sim:
        await sim.enroll(args.devices, token)
        end = dt.datetime.now(dt.UTC)
        prepared = []
        for d in sim.devices:
            load = Load(d.id, d.identity.attributes, sim.seed)
            batch = load.batch(MODELS, end - dt.timedelta(seconds=60), end, [])
            prepared.append((d, batch, [time.time()]))
        size = sum(b.ByteSize() for _, b, _ in prepared) / len(prepared)
        payload = os.urandom(int(size))

        async def report(i: int, stop: float, counts: list[int]) -> None:
            # Caller i takes turns over devices i, i + concurrency, ...: each device is one
            # caller's, its batches in order; and with devices enough, each batch covers
            # the fraction of a second a device's real load fits (the server caps a
            # device's inferences per second of its own time).
            mine = prepared[i :: args.concurrency]
            turn = 0
            while time.monotonic() < stop:
                device, batch, last_end = mine[turn % len(mine)]
                turn += 1
                # Each call a new batch over the time since the device's last one, as
                # agents send (the server refuses overlapping periods).
                now = time.time()
                batch.batch_id = new_batch_id()
                batch.period_start.FromNanoseconds(int(last_end[0] * 1e9))
                batch.period_end.FromNanoseconds(int(now * 1e9))
                last_end[0] = now
                await device._conn.report(batch)
                counts[0] += 1

        async with grpc.aio.insecure_channel(echo_address) as channel:
            call = channel.unary_unary(ECHO_PATH)

            async def echo(i: int, stop: float, counts: list[int]) -> None:
                while time.monotonic() < stop:
                    await call(payload, timeout=30)
                    counts[0] += 1

            rounds = []
            for _ in range(args.rounds):
                cpu = cpu_seconds(server_pid)
                rate, batches = await _timed(report, args.concurrency, args.window)
                await asyncio.sleep(ROLLUP_INTERVAL_S + 1)
                report_us = (cpu_seconds(server_pid) - cpu) * 1e6 / batches
                cpu = cpu_seconds(echo_pid)
                echo_rate, calls = await _timed(echo, args.concurrency, args.window)
                echo_us = (cpu_seconds(echo_pid) - cpu) * 1e6 / calls
                rounds.append((rate, echo_rate, report_us, echo_us))
        return rounds, size


async def _timed(worker, concurrency: int, window: float) -> tuple[float, int]:
    """Run `worker` on `concurrency` callers: a second's warm-up, then `window` seconds timed.

    Returns (calls per second, calls) of the timed part; CPU measured around this call
    counts the warm-up's calls too, so they are added to the count.
    """
    warm = [0]
    await asyncio.gather(*(worker(i, time.monotonic() + 1.0, warm) for i in range(concurrency)))
    counts = [0]
    started = time.monotonic()
    await asyncio.gather(*(worker(i, started + window, counts) for i in range(concurrency)))
    return counts[0] / (time.monotonic() - started), counts[0] + warm[0]


def run_backend(name: str, db_url: str | None, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"skiff-bench-telemetry-{name}-") as tmp_name:
        tmp = Path(tmp_name)
        home, log = tmp / "home", tmp / "server.log"
        init_plain_home(home, db_url)
        cli = [sys.executable, "-m", "control_plane.cli"]
        server, address = start_process(
            [*cli, "server", "--home", str(home), "--grpc", "127.0.0.1:0", "--workers", "1"],
            log,
            "listening on ",
        )
        echo = None
        try:
            with AdminClient(address, read_token(home), None) as client:
                token = client.create_enrollment_token(uses=args.devices).token
                publish(client, tmp)
            echo, echo_address = start_process(
                [sys.executable, str(BENCH / "_echo.py"), "--response-bytes", "16"],
                log,
                "echo listening on ",
            )
            pids = (server.pid, echo.pid)
            rounds, size = asyncio.run(ingestion(address, echo_address, token, pids, args))
        finally:
            if echo is not None:
                stop_process(echo)
            stop_process(server)
    rate = statistics.median(r[0] for r in rounds)
    echo_rate = statistics.median(r[1] for r in rounds)
    ratio = statistics.median(r[0] / r[1] for r in rounds)
    report_us = statistics.median(r[2] for r in rounds)
    echo_us = statistics.median(r[3] for r in rounds)
    print(
        f"{name}: {rate:,.0f} Report batches/s ({size:.0f} B each, {len(MODELS)} models); "
        f"bare echo {echo_rate:,.0f} calls/s: ratio {ratio:.2f} (aim >= 0.5; median of "
        f"{len(rounds)} interleaved rounds: {', '.join(f'{r[0] / r[1]:.2f}' for r in rounds)}); "
        f"server CPU {report_us:,.0f} us per batch (rolling included), echo {echo_us:,.0f} "
        "us per call",
        flush=True,
    )
    return {
        f"report_batches_per_s_{name}": round(rate, 1),
        f"echo_calls_per_s_{name}": round(echo_rate, 1),
        f"report_vs_echo_{name}": round(ratio, 3),
        f"report_server_cpu_us_{name}": round(report_us),
        f"echo_server_cpu_us_{name}": round(echo_us),
        "batch_bytes": round(size),
    }


HEALTH_DEVICES = 10_000
HEALTH_DAYS = 30
SOCS = [f"soc{i}" for i in range(10)]
OS_MAJORS = ["13", "14"]
CONFIGS = ["CPU/normal/t2/mem-normal", "OPENCL/low/t4/mem-normal"]


def health_query(name: str, db_url: str | None, *, late: bool = False) -> dict:
    """Fill a database with 30 days of rollups of 10k devices; time the health view.

    `late`: its sixth stage (four more windows before the current one), and as many
    devices outside the rollout (their rows in the current window).
    """
    import numpy as np

    from control_plane.blas_threads import one_blas_thread
    from control_plane.rollouts.guard import Guard
    from control_plane.store import orm
    from control_plane.store.rollouts import RolloutRecord
    from control_plane.store.rollup_aggregate import COUNTERS, encode_buckets
    from control_plane.store.rollup_records import BASELINE, CANDIDATE, OUTSIDE, DeviceKey
    from control_plane.store.sql_store import SqlStore
    from control_plane.telemetry.classes import parse_device_class
    from control_plane.telemetry.roller import HOUR, bucket_start
    from runtime.histogram import LatencyHistogram

    with tempfile.TemporaryDirectory(prefix="skiff-bench-health-") as tmp:
        store = SqlStore(db_url or f"sqlite:///{tmp}/skiff.db")
        classes = parse_device_class("soc,device_model,os_version:major")
        now = dt.datetime.now(dt.UTC)
        start = bucket_start(now - dt.timedelta(days=HEALTH_DAYS), HOUR)
        rollout = RolloutRecord(
            "ro_bench00001",
            "ctr",
            2,
            "fp32",
            "",
            # Late: its sixth stage, five windows before the current one.
            (1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0) if late else (10.0, 50.0, 100.0),
            5 if late else 0,
            "active",
            3600,
            0,
            start,
            "bench",
            start,
            halt_rules=("p95_latency_ratio>1.2", "crash_rate>0.001", "error_rate>0.01"),
            min_devices=50,
            min_inferences=1000,
            slice_by="soc",
        )
        rng = np.random.default_rng(0)
        attrs = [
            {
                "soc": SOCS[i % len(SOCS)],
                "device_model": f"Phone {i % 7}",
                "os_version": OS_MAJORS[i % 2] + ".1",
            }
            for i in range(HEALTH_DEVICES * (2 if late else 1))  # outside ones after
        ]
        with store._scope() as session:  # bench set-up: rows as the roller would leave them
            session.execute(
                orm.DeviceRow.__table__.insert(),
                [
                    {
                        "id": f"dev_{i:016x}",
                        "credential_sha256": f"{i:064x}",
                        "public_keyset": b"k",
                        "attributes": a,
                        "stamped_attributes": {},
                        "enrollment_token_id": "bench",
                        "enrolled_at": start,
                    }
                    for i, a in enumerate(attrs)
                ],
            )
        # As the roller leaves a rollout's device rows: per device, config and cohort,
        # for the current stage's window and the weeks before it.
        stage = start + dt.timedelta(days=HEALTH_DAYS - 1)
        earlier = (start, *(start + dt.timedelta(days=5 * k) for k in range(1, 5) if late))
        device_rows = []
        for i, a in enumerate(attrs):
            cohort = CANDIDATE if i // len(SOCS) % 10 == 0 else BASELINE  # 10% of each SoC
            if i >= HEALTH_DEVICES:  # reports the model, never selected
                cohort = OUTSIDE
            for w in (stage,) if cohort == OUTSIDE else (*earlier, stage):
                for config in CONFIGS:
                    h = LatencyHistogram()
                    h.record_many_ns(rng.lognormal(np.log(2e6), 0.3, 64))
                    counts = h.counts * (500 if w == stage else 30 * 500)
                    key = DeviceKey(
                        rollout.id,
                        w,
                        cohort,
                        "ctr",
                        2 if cohort == CANDIDATE else 1,
                        "fp32",
                        config,
                        f"dev_{i:016x}",
                    )
                    device_rows.append(
                        {
                            "key": key.digest,
                            "scope": key.scope,
                            "window_start": key.window,
                            "cohort": key.cohort,
                            "model": key.model,
                            "version": key.version,
                            "variant": key.variant,
                            "config": key.config,
                            "device_id": key.device_id,
                            "device_class": json.dumps({"soc": a["soc"]}),
                            "last_seen": now,
                            "reports": 60,
                            **dict.fromkeys(COUNTERS, 0),
                            "inferences": int(counts.sum()),
                            "crash_signals": {},
                            "latency_count": int(counts.sum()),
                            "latency_sum_ns": int(counts.sum()) * 2_000_000,
                            "latency_min_ns": h.min_ns,
                            "latency_max_ns": h.max_ns,
                            "latency_buckets": encode_buckets(counts),
                        }
                    )
        with store._scope() as session:
            session.execute(orm.DeviceRollupRow.__table__.insert(), device_rows)
        rollout = dataclasses.replace(rollout, stage_started_at=stage)

        rows = len(device_rows)
        one_blas_thread()  # as a server process runs the guard (control_plane.serve)
        guard = Guard(store, None, classes)
        health = guard.health(rollout)  # warm
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            health = guard.health(rollout)
            times.append((time.perf_counter() - t0) * 1000)
        store.close()
    ms = sorted(times)[len(times) // 2]
    shape = "aim <= 200"
    if late:
        shape = f"{len(earlier) + 1} stage windows, {HEALTH_DEVICES:,} devices outside"
    print(
        f"{name}: health view of a 30-day rollout over {HEALTH_DEVICES:,} devices "
        f"({rows:,} device rows, {len(health.slices)} slices): {ms:.0f} ms median ({shape})",
        flush=True,
    )
    if late:
        return {f"health_query_late_ms_{name}": round(ms, 1), "health_late_device_rows": rows}
    return {f"health_query_ms_{name}": round(ms, 1), "health_device_rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 s windows")
    parser.add_argument("--devices", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--window", type=float, default=0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=0, help="Report/echo rounds (median)")
    args = parser.parse_args()
    args.window = args.window or (5.0 if args.quick else 10.0)
    args.rounds = args.rounds or (2 if args.quick else 3)
    results: dict = {"devices": args.devices, "concurrency": args.concurrency}
    results["window_s"], results["rounds"] = args.window, args.rounds
    results["cores"] = os.cpu_count()
    results.update(run_backend("sqlite", None, args))
    pg_url, drop = pg_database(PG_ADMIN)
    try:
        results.update(run_backend("postgresql", pg_url, args))
    finally:
        drop()
    for late in (False, True):
        for name in ("sqlite", "postgresql"):
            url, done = pg_database(PG_ADMIN) if name == "postgresql" else (None, None)
            try:
                results.update(health_query(name, url, late=late))
            finally:
                if done is not None:
                    done()
    # The bare keys hold the weaker database's figure: what the aims are checked against.
    for key, worst in (
        ("report_batches_per_s", min),
        ("report_vs_echo", min),
        ("health_query_ms", max),
    ):
        results[key] = worst(results[f"{key}_sqlite"], results[f"{key}_postgresql"])
    results["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(f"reproduce: {results['command']}")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
