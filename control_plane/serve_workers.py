"""`skiff server --workers N`: N server processes sharing one port, one home, one database.

One Python process is one core (the GIL). A supervisor process holds the home's lock,
reserves the listening port with SO_REUSEPORT, as gRPC's own multiprocessing example
does, and starts N ordinary `skiff server` processes that listen on it with SO_REUSEPORT:
the kernel spreads connections over them (a connection, and every call on it, stays with
one worker). Workers are replicas of one home: they share the PostgreSQL database and
hear each other's changes through its change feed, so Watch streams, revocations and
change notifications behave as with separate replicas. SQLite has no way to tell one
process of another's commits: a SQLite home serves one process.

The supervisor prints one "listening" line once every worker listens, forwards SIGINT and
SIGTERM and exits when the workers have. A worker that dies stops the others and the
supervisor exits 1: the service manager (systemd, Kubernetes) restarts the whole.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from sqlalchemy.engine import url as sa_url

from contract import errors
from control_plane.api.transport import check_listen, listen_credentials
from control_plane.home import HomeLock
from control_plane.settings import FROM_FLAG, SETTINGS, Config
from control_plane.store.sql_store import SqlStore
from runtime.hardening import forbid_core_dumps

log = logging.getLogger(__name__)

MAX_WORKERS = 256
# How long every worker has to start listening (each builds the app, opens the database).
START_TIMEOUT_S = 120.0
READY_MARK = "listening on "
STOP_POLL_S = 0.5
STRANGER_CHECK_S = 10.0


# The cgroup (v2) CPU limit of this process's container, when it has one.
CPU_MAX = "/sys/fs/cgroup/cpu.max"
# The environment variable a worker finds its supervisor's pid in (see `check_worker`).
SUPERVISOR_ENV = "SKIFF_SERVER_SUPERVISOR"
# Per worker, PostgreSQL connections kept at most, and the share of max_connections
# (the rest for other clients, replicas' listeners, the operator) that N workers divide.
MIN_POOL, MAX_POOL, POOL_SHARE = 4, 24, 0.75


def host_cores(cpu_max: str = CPU_MAX) -> int:
    """Return the cores this process may use: its CPU affinity, within a CPU quota.

    A container limited by a quota (cgroup v2 cpu.max, "200000 100000" = 2 cores) sees
    every core of the host in its affinity; one worker per host core would oversubscribe.
    """
    cores = max(1, len(os.sched_getaffinity(0)))
    try:
        quota, period = Path(cpu_max).read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit here
    return cores


def pool_share(config: Config, count: int) -> int:
    """Return the connections each of `count` workers keeps.

    The db_pool_size setting, or else an even share of POOL_SHARE of PostgreSQL's
    max_connections, MIN_POOL to MAX_POOL. Unavailable (one line) when PostgreSQL cannot
    be asked.
    """
    if config.db_pool_size:
        return config.db_pool_size
    from sqlalchemy import create_engine, text

    engine = create_engine(config.db, connect_args={"connect_timeout": 5})
    try:
        with engine.connect() as conn:
            limit = int(conn.execute(text("SHOW max_connections")).scalar_one())
    except Exception as exc:  # noqa: BLE001 - any failure to ask: one line
        raise errors.Unavailable(f"cannot reach the database: {type(exc).__name__}") from None
    finally:
        engine.dispose()
    share = int(limit * POOL_SHARE) // count
    if share < MIN_POOL:
        log.warning(
            "%d workers x %d connections exceed PostgreSQL's max_connections (%d): raise "
            "it, or run fewer --workers",
            count,
            MIN_POOL,
            limit,
        )
    return max(MIN_POOL, min(MAX_POOL, share))


def check_worker(index: int) -> None:
    """Refuse `--worker-index` outside `skiff server --workers` (it skips the home's lock).

    The supervisor names itself in the environment; a worker's parent must be it.
    """
    if os.environ.get(SUPERVISOR_ENV) != str(os.getppid()):
        raise errors.InvalidArgument(
            f"--worker-index {index} is for the processes of skiff server --workers; "
            "run skiff server (add --workers N for several processes)"
        )


def worker_count(config: Config, requested: int | None) -> int:
    """Return how many server processes to run: `requested`, or by default the cores.

    InvalidArgument for a count out of range, or more than one on SQLite.
    """
    postgres = sa_url.make_url(config.db).get_backend_name() == "postgresql"
    if requested is None:
        return host_cores() if postgres else 1
    if not 1 <= requested <= MAX_WORKERS:
        raise errors.InvalidArgument(f"--workers must be 1 to {MAX_WORKERS}, got {requested}")
    if requested > 1 and not postgres:
        raise errors.InvalidArgument(
            f"--workers {requested} needs a PostgreSQL database (--db): workers hear each "
            "other's changes through it, and SQLite has no way to tell them"
        )
    return requested


def reserve_port(address: str) -> tuple[socket.socket, str, int]:
    """Bind (not listen) a SO_REUSEPORT socket on `address`; returns it, the host, the port.

    Held open for the server's life: workers bind beside it, and a program that does not
    ask to share the port cannot take it meanwhile (even while a worker restarts).
    """
    if address.startswith("unix:"):
        raise errors.InvalidArgument("--workers needs a HOST:PORT --grpc address, not a socket")
    host, _, port = address.removeprefix("dns:///").rpartition(":")
    bare = host.removeprefix("[").removesuffix("]")
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        bare or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(sockaddr)
    except OSError as exc:
        sock.close()
        raise errors.Unavailable(f"cannot listen on {address}: {exc.strerror}") from None
    return sock, host, sock.getsockname()[1]


def _worker_environ(config: Config, pool: int) -> dict[str, str]:
    """Return the environment a worker resolves the supervisor's very settings from.

    Settings given as flags travel as their SKIFF_* variables, not as arguments: a
    database URL may carry a password, and any user may read a process's arguments.
    """
    env = dict(os.environ)
    for s in SETTINGS:
        origin, value = config.origins[s.name]
        if origin == FROM_FLAG and s.name != "grpc":
            env[s.env] = str(value)
    env["SKIFF_DB_POOL_SIZE"] = str(pool)
    env[SUPERVISOR_ENV] = str(os.getpid())
    return env


def _relay(stream, heard: queue.Queue) -> None:
    """Pass a worker's lines to `heard` up to its "listening" line, then copy the rest.

    None in `heard` says the worker's output ended first (it exited).
    """
    for line in stream:
        heard.put(line)
        if READY_MARK in line:
            shutil.copyfileobj(stream, sys.stdout)
            return
    heard.put(None)


class _Workers:
    """The worker processes: started, watched, stopped."""

    def __init__(self, config: Config, address: str, count: int, replica: bool, pool: int) -> None:
        command = [sys.executable, "-m", "control_plane.cli", "server"]
        command += ["--home", str(config.home), "--grpc", address]
        command += ["--replica"] if replica else []
        env = _worker_environ(config, pool)
        self.procs: list[subprocess.Popen] = []
        for index in range(count):
            self.procs.append(
                subprocess.Popen(
                    [*command, "--worker-index", str(index)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    env=env,
                    text=True,
                    # Its own process group: a terminal's Ctrl-C reaches the supervisor
                    # alone, which stops the workers in order (no tracebacks from each).
                    process_group=0,
                )
            )

    def wait_ready(self, timeout: float, stop: threading.Event) -> list[str] | None:
        """Return every worker's first stdout lines up to its "listening" line.

        Unavailable when a worker exits or stays silent past `timeout`; None once `stop`
        is set (a SIGTERM during the start). A thread per worker reads its lines (a
        worker may write several at once: select() on the pipe would miss those already
        buffered) and, once it is ready, passes on whatever it prints later.
        """
        deadline = time.monotonic() + timeout
        lines: list[str] = []
        for index, proc in enumerate(self.procs):
            heard: queue.Queue[str | None] = queue.Queue()
            threading.Thread(target=_relay, args=(proc.stdout, heard), daemon=True).start()
            while True:
                left = deadline - time.monotonic()
                try:
                    line = heard.get(timeout=max(0.0, min(left, STOP_POLL_S)))
                except queue.Empty:
                    if stop.is_set():
                        return None
                    if left > STOP_POLL_S:
                        continue
                    line = None
                if line is None:
                    if stop.is_set():
                        return None
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(timeout=5)  # its output ended: it is exiting
                    why = "did not start in time" if proc.poll() is None else "exited"
                    raise errors.Unavailable(f"server worker {index} {why} (see its log above)")
                lines.append(line)
                if READY_MARK in line:
                    break
        return lines

    def exited(self) -> tuple[int, int] | None:
        """Return (index, status) of a worker that has exited, if any."""
        for index, proc in enumerate(self.procs):
            status = proc.poll()
            if status is not None:
                return index, status
        return None

    def stop(self, timeout: float) -> None:
        """SIGTERM every worker, wait up to `timeout` for all, SIGKILL what is left."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("server worker pid %d ignored SIGTERM; killing it", proc.pid)
                proc.kill()
                proc.wait()


class _Strangers:
    """Watches for another program listening on the workers' port.

    The workers listen with SO_REUSEPORT, so any process of the same user that asks for
    it (gRPC does by default) may listen on the port too and take a share of the
    connections; the kernel keeps other users out. Such a listener is logged (once) as an
    error naming its socket, every STRANGER_CHECK_S.
    """

    def __init__(self, port: int, pids: list[int]) -> None:
        self._port, self._pids = port, pids
        self._next = 0.0
        self._told: set[str] = set()

    def check(self) -> None:
        """Log listeners on the port that no worker holds (at most every STRANGER_CHECK_S)."""
        if time.monotonic() < self._next:
            return
        self._next = time.monotonic() + STRANGER_CHECK_S
        ours = set()
        for pid in self._pids:
            with contextlib.suppress(OSError):
                for fd in os.listdir(f"/proc/{pid}/fd"):
                    with contextlib.suppress(OSError):
                        ours.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        for inode in _listening(self._port) - self._told:
            if f"socket:[{inode}]" not in ours:
                self._told.add(inode)
                log.error(
                    "another program listens on port %d beside the server workers (socket "
                    "inode %s; `ss -ltnp 'sport = :%d'` names it) and takes a share of "
                    "their connections: stop it",
                    self._port,
                    inode,
                    self._port,
                )


def _listening(port: int) -> set[str]:
    """Return the socket inodes of TCP listeners on `port` (this network namespace)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f, None)
            for line in f:
                fields = line.split()
                if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    found.add(fields[9])
    return found


def serve_workers(
    *, config: Config, count: int, replica: bool, stop_limit_s: float, poll_s: float
) -> int:
    """Run `count` server processes on the --grpc address until SIGINT/SIGTERM.

    Returns the exit status: 0 after a requested stop, 1 when a worker died.
    """
    forbid_core_dumps()
    address = config.grpc
    credentials = listen_credentials(config, address)  # refused before anything starts
    # Whatever the workers would fail on fails here once: the address, the database.
    check_listen(address, reuse_port=replica)  # a plain one: taken even by a sharer
    lock = HomeLock(config.home, shared=replica).acquire()
    try:
        pool = pool_share(config, count)
        # The schema is brought up to date once, here (a store migrates as it opens),
        # not by every worker at once.
        SqlStore(config.db, pool_size=1).close()
        reservation, host, port = reserve_port(address)
    except BaseException:
        lock.release()
        raise
    lock.describe(f"{host}:{port}, {count} workers")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workers = _Workers(config, f"{host}:{port}", count, replica, pool)
    try:
        lines = workers.wait_ready(START_TIMEOUT_S, stop)
        if lines is None:  # asked to stop before every worker listened
            return 0
        transport = "TLS" if credentials is not None else "plaintext, this machine only"
        print(
            f"skiff server listening on {host}:{port} ({transport}; home {config.home}; "
            f"{count} workers)",
            flush=True,
        )
        for line in lines:  # the dashboard's address (worker 0 serves it)
            if READY_MARK not in line:
                print(line, end="", flush=True)
        strangers = _Strangers(port, [p.pid for p in workers.procs])
        while not stop.wait(poll_s):
            died = workers.exited()
            if died is not None:
                log.error("server worker %d exited with status %d; stopping the others", *died)
                return 1
            strangers.check()
        return 0
    finally:  # however the supervisor leaves (an exception too), its workers stop
        workers.stop(stop_limit_s)
        reservation.close()
        lock.release()
