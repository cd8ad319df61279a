"""How fast a rollout promote reaches the devices it adds, and only them.

A fleet of simulated devices (the `skiff sim` engine: real gRPC clients that verify every
signed assignment, unwrap their own keys and install what they are given) enrolls, Syncs
once and holds Watch streams. A rollout of det:1 to `platform=android` with stages 1, 10,
50, 100% is created and promoted to 10% (warm-up). Then the measured promote (10 -> 50%)
adds about a fifth of the fleet (with `--cold`, only after the server's credential cache
has forgotten every device: an hour).
Reported, for one server on SQLite and for two server processes on one PostgreSQL (the
devices split between them, the promote sent to one; the other hears it by NOTIFY):

* per-device propagation: from sending the promote to that device's Sync answer carrying
  det:1 (p50, p99, max), and to having it installed and reported (p99);
* unaffected syncs: devices outside the added band that Synced anyway during the round
  and 2 s after it (the goal is 0: Watch pushes only to devices whose state changed).

`auth_cache` in the JSON says whether the cache was warm (the default) or cold. Beside the
times, the CPU the servers and the simulated fleet spent per device the promote added
(`server_cpu_ms_per_device`, `fleet_cpu_ms_per_device`): on two cores their sum times the
devices added, halved, is about the p99 itself, so the figure shows which side sets it. With
`--fleet-processes K` the fleet runs in K processes (bench/_fleet_slices.py), for machines
whose cores would otherwise sit idle while one Python process simulates every device.
Which devices a promote adds is predicted from the sticky buckets and checked afterwards
against the server's own `fleet ls`. Devices wait uniform(0, jitter) before they Sync, as
agents do; that wait is part of the figure. Without Watch, agents polling every 300 s
would take 150 s on average and up to 300 s. Servers and devices share this machine's
two cores. The last line is one JSON object.

    python bench/propagation.py            # 10,000 devices
    python bench/propagation.py --quick    # 1,000 devices, no cache wait, within a minute
    python bench/propagation.py --devices 20000 --fleet-processes 6 --workers 4  # 16 cores
"""

from __future__ import annotations

import argparse
import asyncio
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
import uuid
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _fleet_slices import MODEL, FleetSlice, RemoteSlice  # noqa: E402

from contract.transport import ClientTls  # noqa: E402
from control_plane.api.client import AdminClient  # noqa: E402
from control_plane.api.transport import client_tls  # noqa: E402
from control_plane.demo import sample_models  # noqa: E402
from control_plane.fleet.devices import AUTH_CACHE_TTL_S  # noqa: E402
from control_plane.home import init_home, read_token  # noqa: E402
from control_plane.settings import load_config  # noqa: E402
from control_plane.sim import SimOptions  # noqa: E402
from protos import fleet_pb2  # noqa: E402

CLI = [sys.executable, "-m", "control_plane.cli"]
PG_ADMIN_URL = os.environ.get("SKIFF_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
SELECTOR, STAGES = "platform=android", (1.0, 10.0, 50.0, 100.0)


# -- servers ---------------------------------------------------------------------------------


def start_servers(
    home: Path, replicas: int, db: str = "", workers: int = 1
) -> list[tuple[subprocess.Popen, str]]:
    """Init `home` (on `db` if given) and run `replicas` servers of `workers` processes."""
    init_home(load_config(home, {"db": db} if db else {}, environ={}))
    procs = []
    # Several servers of one home are replicas on purpose: without it the second is refused.
    replica = ["--replica"] if replicas > 1 else []
    for i in range(replicas):  # all started before any is waited for: they boot in parallel
        log = home.parent / f"server-{i}.log"
        procs.append(
            subprocess.Popen(
                [*CLI, "server", "--home", str(home), "--grpc", "127.0.0.1:0", *replica]
                + ["--workers", str(workers)],
                stdout=subprocess.PIPE,
                stderr=log.open("w"),
                text=True,
            )
        )
    servers = []
    for i, proc in enumerate(procs):
        line = proc.stdout.readline()
        if "listening on" not in line:
            raise RuntimeError(f"server {i} did not start; see {home.parent}/server-{i}.log")
        servers.append((proc, line.split("listening on ")[1].split()[0]))
    return servers


def stop_servers(servers: list[tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in servers:
        proc.send_signal(signal.SIGTERM)
    for proc, _ in servers:
        proc.wait(timeout=60)


@contextmanager
def fresh_postgres():
    """A new PostgreSQL database on the local server, dropped afterwards."""
    from sqlalchemy import create_engine, text

    admin = create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"skiff_bench_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def push_model(client: AdminClient, tmp: Path) -> None:
    path = tmp / "det.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=1))
    client.push(path, name=MODEL)


# -- the fleet -------------------------------------------------------------------------------


async def all_online(clients: list[AdminClient], n: int, timeout: float = 600) -> None:
    """Wait until the servers hold every device's Watch stream."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        online: set[str] = set()
        for client in clients:  # each replica knows its own streams at once
            devices = await asyncio.to_thread(client.list_devices)
            online |= {d.id for d in devices if d.online}
        if len(online) == n:
            return
        await asyncio.sleep(2.0)  # listing every device costs the servers: not too often
    raise RuntimeError(f"only {len(online)} of {n} devices are watching after {timeout}s")


def cpu_seconds(pids: list[int]) -> float:
    """CPU time (user + system) the processes and their children have used so far."""
    stats = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            stats[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    # A server's workers are its children (a worker gone meanwhile takes its CPU with it).
    tree = set(pids) | {pid for pid, (ppid, _) in stats.items() if ppid in pids}
    return sum(stats[pid][1] for pid in tree if pid in stats) / os.sysconf("SC_CLK_TCK")


async def promote(slices, client: AdminClient, rollout, stage: int, pids: list[int]) -> dict:
    """Promote to `stage`; wait for the devices it adds; return what happened."""
    data = rollout.SerializeToString()
    added = sum(await asyncio.gather(*(s.arm(data, stage) for s in slices)))
    server_cpu = cpu_seconds(pids)
    started = time.monotonic()
    await asyncio.to_thread(client.transition_rollout, rollout.id, "promote", "bench")
    parts = await asyncio.gather(*(s.installed() for s in slices))
    # Until the last added device has installed: what the servers and the simulated fleet
    # spent per device added.
    server_cpu = cpu_seconds(pids) - server_cpu
    woken = sum(await asyncio.gather(*(s.settled() for s in slices)))
    synced = {i: t - started for part in parts for i, t in part["synced"].items()}
    replica = {i: a for part in parts for i, a in part["replica"].items()}
    return {
        "added": added,
        "synced": synced,
        "synced_s": sorted(synced.values()),
        "installed_s": sorted(t - started for p in parts for t in p["installed"].values()),
        "per_replica_p99_s": per_replica(replica, synced),
        "unaffected_syncs": woken,
        "server_cpu_ms_per_device": 1000 * server_cpu / max(1, added),
        "fleet_cpu_ms_per_device": 1000 * sum(p["cpu_s"] for p in parts) / max(1, added),
    }


def check_against_server(client: AdminClient, expected: set[str]) -> None:
    """The server's desired state must match the predicted bands exactly."""
    devices = client.list_devices()
    assigned = {d.id for d in devices if MODEL in d.desired}
    if assigned != expected:
        raise RuntimeError(
            f"prediction differs from the server: {len(assigned ^ expected)} devices disagree"
        )


# -- one scenario ----------------------------------------------------------------------------


def fleet_slices(addresses: list[str], tls: ClientTls, n: int, args) -> list:
    """The fleet: in this process, or split over --fleet-processes child processes."""
    k, replicas = args.fleet_processes, len(addresses)
    # Up to 500 devices a connection, at least two connections a replica per slice, and 8
    # a worker: SO_REUSEPORT spreads connections, not devices, over a server's workers (a
    # real device has a connection of its own).
    workers = args.workers if replicas > 1 else 1
    per_channel = max(1, min(500, n // (2 * replicas * k), n // (8 * replicas * workers)))
    kind = FleetSlice if k == 1 else RemoteSlice
    # As many enrollments in flight in all as one process makes (more only queue up).
    concurrency = max(8, SimOptions.concurrency // k)
    return [
        kind(
            addresses,
            tls,
            seed=i,
            devices_per_channel=per_channel,
            jitter_s=args.jitter,
            concurrency=concurrency,
        )
        for i in range(k)
    ]


async def scenario(
    addresses: list[str], token: str, tls: ClientTls, n: int, args, pids: list[int]
) -> dict:
    """Enroll and watch; create the rollout; warm up; measure one promote (over TLS)."""
    clients = [AdminClient(address, token, tls) for address in addresses]
    slices = fleet_slices(addresses, tls, n, args)
    try:
        enroll = clients[0].create_enrollment_token(uses=n, name="bench").token
        sizes = [n // len(slices) + (i < n % len(slices)) for i in range(len(slices))]
        started = time.perf_counter()
        starts = (s.start(size, enroll) for s, size in zip(slices, sizes, strict=True))
        await asyncio.gather(*starts)
        out: dict = {"enroll_per_s": n / (time.perf_counter() - started)}
        await all_online(clients, n)
        request = fleet_pb2.CreateRolloutRequest(
            model=MODEL, version=1, selector=SELECTOR, stages=STAGES, bake_s=86_400
        )
        rollout = await asyncio.to_thread(clients[0].create_rollout, request)
        await asyncio.gather(*(s.first_stage(rollout.SerializeToString()) for s in slices))
        await promote(slices, clients[0], rollout, 1, pids)  # warm-up
        if args.cold:
            # Let the server's credential cache forget every device first (it lives
            # AUTH_CACHE_TTL_S; a watching device's credential is looked up when its
            # stream opens, so within that time a promote finds it warm).
            await asyncio.sleep(AUTH_CACHE_TTL_S + 1)
        out.update(await promote(slices, clients[0], rollout, 2, pids))
        reached = set().union(*await asyncio.gather(*(s.reached() for s in slices)))
        await asyncio.to_thread(check_against_server, clients[0], reached)
        return out
    finally:
        await asyncio.gather(*(s.close() for s in slices), return_exceptions=True)
        for client in clients:
            client.close()


def per_replica(replica: dict[str, str], synced: dict[str, float]) -> dict[str, float]:
    """p99 propagation of the devices on each replica (the promote went to the first)."""
    out: dict[str, list[float]] = {}
    for device_id, seconds in synced.items():
        out.setdefault(replica[device_id], []).append(seconds)
    return {a: round(quantile(sorted(ts), 0.99), 3) for a, ts in out.items()}


def quantile(sorted_values: list[float], q: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


async def run_case(tmp: Path, n: int, args, replicas: int, db: str = "") -> dict:
    """Start the servers, run the scenario, stop them (blocking steps: nothing else runs)."""
    home = tmp / "home"
    servers = start_servers(home, replicas, db, args.workers if db else 1)
    try:
        addresses = [address for _, address in servers]
        token = read_token(home)
        tls = client_tls(load_config(home, environ={}))
        with AdminClient(addresses[0], token, tls) as client:
            push_model(client, tmp)
        pids = [proc.pid for proc, _ in servers]
        return await scenario(addresses, token, tls, n, args, pids)
    finally:
        stop_servers(servers)


async def both_cases(n: int, args) -> tuple[dict, dict]:
    """One server on SQLite, then two on PostgreSQL, in one event loop.

    One loop for the whole run: grpc.aio binds to the first loop it meets, and a second
    asyncio.run in the same process floods stderr with "Event loop is closed".
    """
    with tempfile.TemporaryDirectory(prefix="skiff-bench-") as tmp:
        one = await run_case(Path(tmp), n, args, 1)
    with tempfile.TemporaryDirectory(prefix="skiff-bench-") as tmp, fresh_postgres() as db:
        two = await run_case(Path(tmp), n, args, 2, db)
    return one, two


def figures(r: dict) -> dict:
    synced = r["synced_s"]
    return {
        "added": r["added"],
        "p50_s": round(statistics.median(synced), 3),
        "p99_s": round(quantile(synced, 0.99), 3),
        "max_s": round(synced[-1], 3),
        "installed_p99_s": round(quantile(r["installed_s"], 0.99), 3),
        "unaffected_syncs": r["unaffected_syncs"],
        "per_replica_p99_s": r["per_replica_p99_s"],
        "server_cpu_ms_per_device": round(r["server_cpu_ms_per_device"], 3),
        "fleet_cpu_ms_per_device": round(r["fleet_cpu_ms_per_device"], 3),
    }


def report(case: str, raw: dict) -> dict:
    """Print one case's figures; return them."""
    f = figures(raw)
    replicas = f"; per replica p99 {f['per_replica_p99_s']}" if case.startswith("two") else ""
    print(
        f"{case}: promote added {f['added']:,} devices: synced p50 {f['p50_s']} s, "
        f"p99 {f['p99_s']} s, max {f['max_s']} s; installed p99 {f['installed_p99_s']} s; "
        f"unaffected devices that synced {f['unaffected_syncs']} "
        f"(enrolled {raw['enroll_per_s']:,.0f}/s){replicas}; CPU per added device: servers "
        f"{f['server_cpu_ms_per_device']} ms, simulated fleet {f['fleet_cpu_ms_per_device']} ms",
        flush=True,
    )
    return f


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1,000 devices, no cache wait; under a minute"
    )
    parser.add_argument("--devices", type=int, default=0, help="override the fleet size")
    parser.add_argument("--jitter", type=float, default=0.5, help="devices' Sync jitter (s)")
    parser.add_argument(
        "--fleet-processes",
        type=int,
        default=1,
        help="simulate the fleet in this many processes (for machines with cores to spare)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes per PostgreSQL server (`skiff server --workers`; SQLite takes one)",
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="wait for the server's credential cache to expire before the measured promote",
    )
    args = parser.parse_args()
    n = args.devices or (1_000 if args.quick else 10_000)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # servers inherit it
    if args.fleet_processes < 1:
        parser.error("--fleet-processes must be at least 1")
    print(
        f"{n:,} devices in {args.fleet_processes} process(es), Sync jitter {args.jitter} s, "
        f"{os.cpu_count()} cores",
        flush=True,
    )
    raw_one, raw_two = asyncio.run(both_cases(n, args))
    one = report("one server (SQLite)", raw_one)
    two = report(
        f"two replicas (PostgreSQL, {args.workers} worker(s) each), promote sent to the first",
        raw_two,
    )
    cache = "cold" if args.cold else "warm"
    results: dict = {"devices": n, "sync_jitter_s": args.jitter, "auth_cache": cache}
    results["fleet_processes"], results["workers_two_replicas"] = args.fleet_processes, args.workers
    for suffix, f in (("", one), ("_two_replicas", two)):
        results.update(
            {
                f"propagation_p50_s{suffix}": f["p50_s"],
                f"propagation_p99_s{suffix}": f["p99_s"],
                f"propagation_max_s{suffix}": f["max_s"],
                f"installed_p99_s{suffix}": f["installed_p99_s"],
                f"unaffected_syncs{suffix}": f["unaffected_syncs"],
                f"affected_devices{suffix}": f["added"],
                f"server_cpu_ms_per_device{suffix}": f["server_cpu_ms_per_device"],
                f"fleet_cpu_ms_per_device{suffix}": f["fleet_cpu_ms_per_device"],
            }
        )
    results["enroll_per_s"] = round(raw_one["enroll_per_s"], 1)
    results["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(f"reproduce: {results['command']}")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
