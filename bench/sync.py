"""DeviceService.Sync calls per second on a realistic fleet, next to bare gRPC unary echo.

Per database backend (SQLite, then PostgreSQL) a real control plane runs in a process of
its own, with 100k devices and 200 rollouts (mixed selectors, stages, priorities; some
completed, paused or rolled back) over 8 models of 2 versions, two shipped to every
platform and six to one platform each (models per Sync is reported). Beside it, in another
process, a bare grpc.aio unary echo on the same kind of server (the control plane's
SERVER_OPTIONS) answering with as many bytes as a real Sync answer. Two client
processes (grpc.aio, raw bytes, 64 calls in flight over 4 connections, devices
round-robin so every call is a different device) drive, in interleaved rounds:

* echo: the baseline;
* Sync, worst case: devices report nothing installed, so every assigned model's data
  key is HPKE-wrapped to the device, and the assignment is signed;
* Sync, steady state: devices report their desired versions installed (no key wrap),
  each device a different one, so the server looks its credential up (a device's first
  Sync in the hour its credential stays cached);
* Sync, warm: the same, from 1,000 devices per client that Synced before the rounds (a
  device that polls or is pushed again within the hour: the common case of a fleet in
  steady state), answered from memory on the event loop.

Before the timed rounds, real Sync answers for a sample of devices are checked end to end
with the device agent's verifier against what the server's resolver says over the same
database (versions, signatures, wrapped keys that open, none when installed).
Each figure is the median over rounds. Beside it: the server's CPU time per call, and
the share of a core used by the server, by the clients and by everything else
(PostgreSQL, other work on a shared machine): with 2 cores, they all compete. Calls
that fail and warnings the server logs are counted and reported. The last line is one
JSON object.

    python bench/sync.py            # 100k devices, 200 rollouts, SQLite and PostgreSQL
    python bench/sync.py --quick    # 10k devices, 50 rollouts, 3 models; < 1 min a backend
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from sqlalchemy import create_engine, text

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH.parent))
sys.path.insert(0, str(BENCH))

import _sync_fleet as fleet  # noqa: E402

from control_plane.api.client import AdminClient  # noqa: E402
from control_plane.home import read_token  # noqa: E402

PG_ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
KINDS = (("echo", "worst"), ("sync", "worst"), ("sync", "steady"), ("sync", "warm"))
CORES = os.cpu_count() or 1
LABELS = {
    ("echo", "worst"): "echo",
    ("sync", "worst"): "sync",
    ("sync", "steady"): "sync_steady",
    ("sync", "warm"): "sync_warm",
}
# Devices per client process whose credentials are cached before the "warm" rounds.
WARM_DEVICES = 1000


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def postgres_cpu() -> dict[int, float]:
    """CPU seconds of every PostgreSQL process on this machine, by pid."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if Path(f"/proc/{entry}/comm").read_text().strip() == "postgres":
                    found[int(entry)] = cpu_seconds(int(entry))
            except OSError:
                continue
    return found


def children(pid: int) -> list[int]:
    """Pids of `pid`'s child processes (a --workers server's workers)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry))
    return found


def machine_ticks() -> tuple[int, int]:
    """(busy, total) jiffies of the whole machine."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


def start_process(args: list[str], log: Path, marker: str) -> tuple[subprocess.Popen, str]:
    """Start a server process and return it with the address from its first stdout line."""
    proc = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=log.open("ab"), text=True, cwd=BENCH.parent
    )
    line = proc.stdout.readline()
    if marker not in line:
        proc.kill()
        raise RuntimeError(f"{args[1:3]} did not start: {line!r}; see {log}")
    return proc, line.split(marker)[1].split()[0]


def stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Clients:
    """The load-client processes, driven one round at a time."""

    def __init__(
        self,
        files: list[Path],
        sync: str,
        echo: str,
        concurrency: int,
        channels: int = 2,
        parts: int = 1,
    ) -> None:
        """One process per file, or `parts` per file, each with its own share of the devices.

        Two processes that walked the same list would call each device twice in a row, the
        second time from its cache on one server but not on another's worker.
        """
        per = concurrency // (len(files) * parts)
        self.procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    str(BENCH / "_sync_client.py"),
                    "--devices",
                    str(f),
                    "--sync",
                    sync,
                    "--echo",
                    echo,
                    "--concurrency",
                    str(per),
                    "--channels",
                    str(channels),
                    "--part",
                    f"{part}/{parts}",
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for f in files
            for part in range(parts)
        ]
        for p in self.procs:
            json.loads(p.stdout.readline())["ready"]  # noqa: B018 - KeyError if not ready

    def run(self, target: str, mode: str, warmup: float, window: float, pids: list[int]) -> dict:
        """One round: load for warmup + window; OK calls, failures, latency, CPU use."""
        start = time.time() + warmup
        end = start + window
        for p in self.procs:
            p.stdin.write(
                json.dumps(
                    {"op": "run", "target": target, "mode": mode, "start": start, "end": end}
                )
                + "\n"
            )
            p.stdin.flush()
        mine = [p.pid for p in self.procs]
        time.sleep(max(0.0, start - time.time()))
        cpu0, ticks0 = sum(map(cpu_seconds, pids)), machine_ticks()
        load0, pg0 = sum(map(cpu_seconds, mine)), postgres_cpu()
        time.sleep(max(0.0, end - time.time()))
        cpu1, ticks1 = sum(map(cpu_seconds, pids)), machine_ticks()
        load1, pg1 = sum(map(cpu_seconds, mine)), postgres_cpu()
        results = [json.loads(p.stdout.readline()) for p in self.procs]
        ok = sum(r["ok"] for r in results)
        failed: dict[str, int] = {}
        for r in results:
            for code, n in r["failed"].items():
                failed[code] = failed.get(code, 0) + n
        return {
            "rate": ok / window,
            "failed": failed,
            # The worse of the clients' percentiles.
            "p50_ms": max(r["latency_ms"][0] for r in results),
            "p99_ms": max(r["latency_ms"][1] for r in results),
            "cpu_us": (cpu1 - cpu0) / max(ok, 1) * 1e6,
            # PostgreSQL's backends (0 on SQLite): the database's share of each call.
            "pg_cpu_us": max(0.0, sum(pg1.get(p, 0.0) - c for p, c in pg0.items() if p in pg1))
            / max(ok, 1)
            * 1e6,
            "server_cpu": (cpu1 - cpu0) / window,
            "client_cpu": (load1 - load0) / window,
            # Cores busy with anything else: PostgreSQL, and whatever else shares the machine.
            "other_cpu": (ticks1[0] - ticks0[0]) / max(1, ticks1[1] - ticks0[1]) * CORES
            - (cpu1 - cpu0 + load1 - load0) / window,
        }

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.stdin.write(json.dumps({"op": "quit"}) + "\n")
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def setup_fleet(address: str, home: Path, db_url: str, tmp: Path, shape: dict, n_clients: int):
    """Models, rollouts and devices; returns (client files, verify summary, fleet summary)."""
    rng = random.Random(20240601)
    with AdminClient(address, read_token(home)) as admin:
        models = fleet.timed(
            f"push {shape['models']} models x {shape['versions']} versions",
            fleet.push_models,
            admin,
            tmp,
            shape["models"],
            shape["versions"],
        )
        # Before the devices: each transition answers with counts over the whole fleet.
        states = fleet.timed(
            f"create {shape['rollouts']} rollouts",
            fleet.create_rollouts,
            admin,
            models,
            shape["rollouts"],
            rng,
        )
        enrolled = fleet.enroll_one(address, admin, rng)
    devices = fleet.timed(
        f"insert {shape['devices']:,} devices",
        fleet.insert_devices,
        db_url,
        shape["devices"],
        enrolled,
        rng,
    )
    revision, desired = fleet.timed(
        "resolve expected answers",
        fleet.expected_answers,
        db_url,
        [*devices, (enrolled.device_id, enrolled.credential, enrolled.attributes)],
    )
    # desired has one more entry, the enrolled device's (last).
    bodies = [
        fleet.sync_requests(a, d, revision)
        for (_, _, a), d in zip(devices, desired[:-1], strict=True)
    ]
    files = []
    for c in range(n_clients):
        path = tmp / f"client-{c}.pickle"
        with path.open("wb") as f:
            pickle.dump(
                {
                    "auth": [f"Bearer {cred}" for _, cred, _ in devices[c::n_clients]],
                    "worst": [w for w, _ in bodies[c::n_clients]],
                    "steady": [s for _, s in bodies[c::n_clients]],
                    "warm": WARM_DEVICES,
                },
                f,
            )
        files.append(path)
    # Check devices the timed rounds reach last (their credentials are not cached then).
    picks = rng.sample(range(len(devices) // 2, len(devices)), min(shape["check"], len(devices)))
    sample = [(*devices[i][:2], *bodies[i], desired[i]) for i in picks]
    worst, steady = fleet.sync_requests(enrolled.attributes, desired[-1], revision)
    sample.append((enrolled.device_id, enrolled.credential, worst, steady, desired[-1]))
    checked = fleet.timed("check Sync answers", fleet.verify, address, enrolled, sample)
    summary = {
        "rollout_states": states,
        "models_per_sync": round(fleet.models_per_device(desired), 2),
        "request_bytes_worst": round(statistics.median(len(w) for w, _ in bodies)),
        "request_bytes_steady": round(statistics.median(len(s) for _, s in bodies)),
    }
    return files, checked, summary


def run_backend(name: str, db_url: str | None, shape: dict, args) -> dict:
    """Everything for one backend; returns its figures."""
    print(f"\n== {name} ==", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="skiff-bench-sync-") as tmp:
        tmp = Path(tmp)
        home, log = tmp / "home", tmp / "server.log"
        cli = [sys.executable, "-m", "control_plane.cli"]
        subprocess.run(
            [*cli, "init", "--home", str(home), *(["--db", db_url] if db_url else [])],
            check=True,
            capture_output=True,
            cwd=BENCH.parent,
        )
        # Sync is compared with a bare echo server, which speaks plaintext: serve this
        # home the same way (allowed on loopback) so the ratio is the handler's alone.
        stored = json.loads((home / "skiff.json").read_text())
        plain = {k: v for k, v in stored.items() if not k.startswith("tls_")}
        (home / "skiff.json").write_text(json.dumps(plain))
        db_url = db_url or f"sqlite:///{home / 'skiff.db'}"
        serve = [*cli, "server", "--home", str(home), "--grpc", "127.0.0.1:0"]
        replica = ["--replica"] if db_url.startswith("postgresql") else []
        server, address = start_process([*serve, *replica, "--workers", "1"], log, "listening on ")
        echo = clients = None
        scaling: dict = {}
        try:
            files, checked, summary = setup_fleet(address, home, db_url, tmp, shape, args.clients)
            echo, echo_address = start_process(
                [
                    sys.executable,
                    str(BENCH / "_echo.py"),
                    "--response-bytes",
                    str(checked["response_bytes_worst"]),
                ],
                log,
                "echo listening on ",
            )
            clients = Clients(files, address, echo_address, args.concurrency)
            print(f"  server pid {server.pid}, echo pid {echo.pid}", flush=True)
            rounds = {k: [] for k in KINDS}
            # Each "warm" device Syncs once, untimed: its credential is cached from now on.
            clients.run("sync", "warm", 0.0, WARM_DEVICES / 100, [server.pid])
            for r in range(shape["rounds"]):
                for kind in KINDS[r % 4 :] + KINDS[: r % 4]:
                    pid = echo.pid if kind[0] == "echo" else server.pid
                    rounds[kind].append(clients.run(*kind, args.warmup, shape["window"], [pid]))
            alive = server.poll() is None and echo.poll() is None
            if replica and args.workers > 1:
                clients.close()
                clients = None
                stop_process(server)  # idle from here: out of the way of the comparison
                scaling = measure_scaling([*serve, *replica], log, files, shape, args)
        finally:
            if clients:
                clients.close()
            if echo:
                stop_process(echo)
            stop_process(server)
        lines = log.read_text(errors="replace").splitlines()
    if not alive:
        raise RuntimeError(f"a server died during the {name} run:\n" + "\n".join(lines[-20:]))
    warnings = [line for line in lines if " WARNING " in line or " ERROR " in line]
    figures = report(name, rounds, checked, summary, shape, time.perf_counter() - started)
    figures.update({f"{k}_{name}": v for k, v in scaling.items()})
    figures[f"server_warnings_{name}"] = len(warnings)
    if warnings:
        distinct = list(dict.fromkeys(w.split(" ", 2)[-1] for w in warnings))  # no timestamps
        print(
            f"  server logged {len(warnings)} warnings/errors:\n    " + "\n    ".join(distinct[:3])
        )
    return figures


def measure_scaling(serve: list[str], log: Path, files, shape, args) -> dict:
    """Steady-state Sync/s of one worker and of `args.workers`, interleaved rounds.

    Two fresh servers (replicas of the same home: `--workers 1` and `--workers N`), so
    neither starts with credentials cached from the rounds before (a server that had
    would answer its revisits from memory, and look faster); each side gets the same
    client processes, connections and calls in flight, enough connections for the kernel
    to spread them over every worker.
    """
    n = args.workers
    one, one_address = start_process([*serve, "--workers", "1"], log, "listening on ")
    many, many_address = start_process([*serve, "--workers", str(n)], log, "listening on ")
    sides = {}
    try:
        pids = {1: [one.pid], n: [many.pid, *children(many.pid)]}
        n_clients = max(2, n // 2)
        parts = max(1, n_clients // len(files))
        concurrency = max(args.concurrency, 16 * n)
        for count, address in ((1, one_address), (n, many_address)):
            sides[count] = Clients(
                files, address, address, concurrency, channels=2 * n, parts=parts
            )
        rates: dict[int, list] = {1: [], n: []}
        for r in range(shape["rounds"]):
            for count in (1, n) if r % 2 == 0 else (n, 1):
                rates[count].append(
                    sides[count].run("sync", "steady", args.warmup, shape["window"], pids[count])
                )
    finally:
        for side in sides.values():
            side.close()
        stop_process(many)
        stop_process(one)
    med = {
        k: {f: statistics.median(r[f] for r in rs) for f in ("rate", "cpu_us", "pg_cpu_us")}
        for k, rs in rates.items()
    }
    scaling = med[n]["rate"] / med[1]["rate"] / n
    each = {k: ", ".join(f"{r['rate']:,.0f}" for r in rs) for k, rs in rates.items()}
    print(
        f"  scaling      1 worker {med[1]['rate']:8,.0f}/s, {n} workers {med[n]['rate']:8,.0f}/s"
        f"  sync_scaling {scaling:.2f} (aim >= 0.8 with a core per worker; this machine has "
        f"{CORES} cores for the workers, their clients and PostgreSQL)  server CPU "
        f"{med[1]['cpu_us']:,.0f} / {med[n]['cpu_us']:,.0f} us/call, PostgreSQL "
        f"{med[1]['pg_cpu_us']:,.0f} / {med[n]['pg_cpu_us']:,.0f} us/call  "
        f"[rounds: {each[1]} | {each[n]}]",
        flush=True,
    )
    return {
        "sync_steady_per_s_1_worker": round(med[1]["rate"], 1),
        f"sync_steady_per_s_{n}_workers": round(med[n]["rate"], 1),
        "workers": n,
        "sync_scaling": round(scaling, 3),
    }


def report(name, rounds, checked, summary, shape, seconds) -> dict:
    med = {
        k: {f: statistics.median(r[f] for r in rs) for f in rs[0] if f != "failed"}
        for k, rs in rounds.items()
    }
    failed: dict[str, int] = {}
    for rs in rounds.values():
        for r in rs:
            for code, n in r["failed"].items():
                failed[code] = failed.get(code, 0) + n
    echo = med[KINDS[0]]["rate"]
    print(
        f"  {shape['devices']:,} devices, {shape['rollouts']} rollouts "
        f"{summary['rollout_states']}, "
        f"{summary['models_per_sync']} models per Sync; checked {checked['checked_devices']} "
        f"devices' answers; Sync answer {checked['response_bytes_worst']:,} B worst case, "
        f"{checked['response_bytes_steady']:,} B steady"
    )
    out = {}
    for kind in KINDS:
        m, label = med[kind], LABELS[kind]
        ratio = m["rate"] / echo
        each = ", ".join(f"{r['rate']:,.0f}" for r in rounds[kind])
        print(
            f"  {label:12s} {m['rate']:8,.0f}/s  ({ratio:.2f}x echo)  p50 {m['p50_ms']:6.1f} ms  "
            f"p99 {m['p99_ms']:6.1f} ms  server CPU {m['cpu_us']:5,.0f} us/call "
            f"(PostgreSQL {m['pg_cpu_us']:,.0f}), "
            f"({m['server_cpu']:.0%} of a core), clients {m['client_cpu']:.0%}, "
            f"other {m['other_cpu']:.0%}  "
            f"[rounds: {each}]"
        )
        out[f"{label}_per_s_{name}"] = round(m["rate"], 1)
        out[f"{label}_server_cpu_us_{name}"] = round(m["cpu_us"], 1)
        out[f"{label}_postgres_cpu_us_{name}"] = round(m["pg_cpu_us"], 1)
        out[f"{label}_p99_ms_{name}"] = round(m["p99_ms"], 1)
        if kind[0] == "sync":
            suffix = "" if kind[1] == "worst" else f"_{kind[1]}"
            out[f"sync{suffix}_vs_echo_{name}"] = round(ratio, 3)
    out[f"failed_calls_{name}"] = sum(failed.values())
    if failed:
        print(f"  FAILED CALLS ({name}): {failed}")
    else:
        print("  no failed calls")
    out[f"models_per_sync_{name}"] = summary["models_per_sync"]
    out[f"runtime_s_{name}"] = round(seconds, 1)
    print(f"  {name} run took {seconds:.0f} s", flush=True)
    return out


def pg_database(admin_url: str):
    """Create a fresh database; return (its URL, a function that drops it)."""
    admin = create_engine(
        admin_url, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 5}
    )
    name = f"skiff_bench_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return admin_url.rsplit("/", 1)[0] + "/" + name, drop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="10k devices, 50 rollouts; under a minute per backend"
    )
    parser.add_argument("--backends", default="sqlite,postgres")
    parser.add_argument(
        "--pg",
        default=os.environ.get("SKIFF_TEST_PG", PG_ADMIN_URL),
        help="an existing PostgreSQL database to create the bench's from",
    )
    parser.add_argument("--clients", type=int, default=2, help="client processes")
    parser.add_argument("--concurrency", type=int, default=64, help="calls in flight in all")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before each window")
    parser.add_argument(
        "--workers",
        type=int,
        default=CORES,
        help="PostgreSQL: also compare steady Sync/s of `skiff server --workers N` with one "
        "worker (sync_scaling); 1 skips it",
    )
    args = parser.parse_args()
    if args.quick:
        shape = dict(
            devices=10_000, rollouts=50, models=3, versions=1, rounds=3, window=2.0, check=50
        )
        args.warmup = min(args.warmup, 0.5)
    else:
        shape = dict(
            devices=100_000, rollouts=200, models=8, versions=2, rounds=5, window=5.0, check=200
        )
    started = time.perf_counter()
    results: dict = {
        "devices": shape["devices"],
        "rollouts": shape["rollouts"],
        "concurrency": args.concurrency,
        "client_processes": args.clients,
        "cpu_cores": os.cpu_count(),
    }
    for backend in args.backends.split(","):
        if backend == "sqlite":
            results.update(run_backend("sqlite", None, shape, args))
        elif backend == "postgres":
            url, drop = pg_database(args.pg)
            try:
                results.update(run_backend("postgres", url, shape, args))
            finally:
                drop()
        else:
            parser.error(f"unknown backend {backend!r}")
    echoes = [v for k, v in results.items() if k.startswith("echo_per_s_")]
    results["echo_per_s"] = round(statistics.median(echoes), 1)
    results["runtime_s"] = round(time.perf_counter() - started, 1)
    results["command"] = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(f"\nreproduce: {results['command']}  ({results['runtime_s']:.0f} s)")
    print(json.dumps(results, sort_keys=True))


if __name__ == "__main__":
    main()
