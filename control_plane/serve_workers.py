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

from sqlalchemy.engine import url as sa_url

from contract import errors
from control_plane.api.transport import check_listen, listen_credentials
from control_plane.home import HomeLock
from control_plane.settings import FROM_FLAG, SETTINGS, Config
from runtime.hardening import forbid_core_dumps

log = logging.getLogger(__name__)

MAX_WORKERS = 256
# How long every worker has to start listening (each builds the app, opens the database).
START_TIMEOUT_S = 120.0
READY_MARK = "listening on "
STOP_POLL_S = 0.5


def host_cores() -> int:
    """Return the cores this process may run on (its CPU affinity, not the whole host's)."""
    return max(1, len(os.sched_getaffinity(0)))


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


def _worker_environ(config: Config) -> dict[str, str]:
    """Return the environment a worker resolves the supervisor's very settings from.

    Settings given as flags travel as their SKIFF_* variables, not as arguments: a
    database URL may carry a password, and any user may read a process's arguments.
    """
    env = dict(os.environ)
    for s in SETTINGS:
        origin, value = config.origins[s.name]
        if origin == FROM_FLAG and s.name != "grpc":
            env[s.env] = str(value)
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

    def __init__(self, config: Config, address: str, count: int, replica: bool) -> None:
        command = [sys.executable, "-m", "control_plane.cli", "server"]
        command += ["--home", str(config.home), "--grpc", address]
        command += ["--replica"] if replica else []
        env = _worker_environ(config)
        self.procs: list[subprocess.Popen] = []
        for index in range(count):
            self.procs.append(
                subprocess.Popen(
                    [*command, "--worker-index", str(index)],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    env=env,
                    text=True,
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


def serve_workers(
    *, config: Config, count: int, replica: bool, stop_limit_s: float, poll_s: float
) -> int:
    """Run `count` server processes on the --grpc address until SIGINT/SIGTERM.

    Returns the exit status: 0 after a requested stop, 1 when a worker died.
    """
    forbid_core_dumps()
    address = config.grpc
    credentials = listen_credentials(config, address)  # refused before anything starts
    lock = HomeLock(config.home, shared=replica).acquire()
    try:
        if not replica:
            check_listen(address)  # taken, even by a server sharing its port: refused
        reservation, host, port = reserve_port(address)
    except BaseException:
        lock.release()
        raise
    lock.describe(f"{host}:{port}, {count} workers")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    workers = _Workers(config, f"{host}:{port}", count, replica)
    try:
        try:
            lines = workers.wait_ready(START_TIMEOUT_S, stop)
        except errors.SkiffError:
            workers.stop(stop_limit_s)
            raise
        if lines is None:  # asked to stop before every worker listened
            workers.stop(stop_limit_s)
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
        while not stop.wait(poll_s):
            died = workers.exited()
            if died is not None:
                log.error("server worker %d exited with status %d; stopping the others", *died)
                workers.stop(stop_limit_s)
                return 1
        workers.stop(stop_limit_s)
        return 0
    finally:
        reservation.close()
        lock.release()
