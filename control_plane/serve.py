"""Serves an App: the gRPC server, the home's lock, and any HTTP front-end plugged in.

One asyncio gRPC server carries every service: the device API's coroutines (thousands of
idle Watch streams cost no threads) and the admin API's plain handlers, which grpc.aio
runs in a thread pool. The loop runs in a thread of its own, so callers (the CLI, tests,
the demo) drive the server with ordinary blocking calls.

HTTP front-ends (the dashboard and /metrics) are plug-ins found through the `skiff.http`
entry point group, so the control plane never imports them: a server installed without
`skiff[dashboard]` runs gRPC alone and says which extra `--http` needs.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Callable
from concurrent import futures
from functools import partial
from typing import Protocol

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from sqlalchemy.engine import url as sa_url

from contract import errors
from contract.command_line import UsageError
from contract.extras import own_entry_points
from control_plane.api.access import AccessInterceptor, check_table
from control_plane.api.admin_service import AdminServicer
from control_plane.api.auth import ApiTokens, Authenticator, no_admin_hint
from control_plane.api.background import Periodic, stop_all
from control_plane.api.device_service import DeviceServicer
from control_plane.api.fleet_service import FleetServicer, RolloutServicer
from control_plane.api.health import HealthMonitor
from control_plane.api.transport import check_listen, listen_credentials, listen_failure
from control_plane.app import App, build_app, kek_rotation
from control_plane.blas_threads import one_blas_thread
from control_plane.gc_tuning import objects_so_far_kept
from control_plane.home import HomeLock
from control_plane.serve_workers import check_worker, serve_workers, worker_count
from control_plane.settings import Config
from protos import admin_pb2, admin_pb2_grpc, device_pb2, device_pb2_grpc, fleet_pb2, fleet_pb2_grpc
from runtime.hardening import forbid_core_dumps

log = logging.getLogger(__name__)

# Uploads arrive in 1 MiB chunks; leave headroom for the envelope.
MAX_MESSAGE_BYTES = 8 << 20
# Threads for the admin API's blocking handlers (pushes, pulls, listings).
WORKERS = 16
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Server pings on idle streams: a Watch stream through a NAT stays mapped, and a
    # device that vanished without a FIN is noticed (and marked offline) within a minute.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    # Devices ping too (every 30 s); without this the server would answer with GOAWAY.
    ("grpc.http2.min_ping_interval_without_data_ms", 20_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A fleet reconnecting after a restart opens thousands of calls at once; the default
    # limit on calls waiting for the server drops a third of such a burst (FACTS.md).
    ("grpc.server.max_pending_requests", 50_000),
    ("grpc.server.max_pending_requests_hard_limit", 100_000),
    # gRPC turns SO_REUSEPORT on by default: a second server on a taken port would start
    # and silently share its connections. Only replicas started on purpose share a port.
    ("grpc.so_reuseport", 0),
]
# Where HTTP front-ends register: `start(app, address) -> HttpFrontEnd`, bound, not serving.
HTTP_ENTRY_POINTS, DASHBOARD_PLUGIN = "skiff.http", "dashboard"
DASHBOARD_EXTRA = "skiff[dashboard]"


def _options(*, reuse_port: bool) -> list[tuple[str, int]]:
    return [(k, int(reuse_port) if k == "grpc.so_reuseport" else v) for k, v in SERVER_OPTIONS]


class HttpFrontEnd(Protocol):
    """What a `skiff.http` plug-in's start returns: bound to its port, serving on start()."""

    port: int
    url: str

    def start(self) -> HttpFrontEnd: ...  # noqa: D102

    def stop(self) -> None: ...  # noqa: D102


def http_plugin(address: str) -> Callable[[App, str], HttpFrontEnd]:
    """Return the `start` of the HTTP front-end plugged in under `skiff.http`.

    Raises UsageError (exit 2) in one line naming the extra to install when no front-end
    is installed, or when its own dependencies (Flask, Plotly, cheroot...) are missing.
    """
    found = {e.name: e for e in own_entry_points(HTTP_ENTRY_POINTS)}
    plugin = found.get(DASHBOARD_PLUGIN)
    if plugin is None:
        raise UsageError(
            f"--http {address}: this install has no dashboard; pip install '{DASHBOARD_EXTRA}'"
        )
    try:
        return plugin.load()
    except ImportError as exc:  # the plug-in's package is there, its dependencies are not
        raise UsageError(
            f"--http {address}: the dashboard needs {exc.name or 'its dependencies'}, "
            f"which this install lacks; pip install '{DASHBOARD_EXTRA}'"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a broken install: one line, not a traceback
        raise UsageError(
            f"--http {address}: the dashboard ({plugin.value}) failed to load: "
            f"{type(exc).__name__}: {exc}"
        ) from None


class ServerHandle:
    """A started-on-demand asyncio gRPC server running on its own event-loop thread.

    With an `http` address, also the HTTP front-end plugged in (the dashboard and
    /metrics: see http_plugin). With `reuse_port`, other processes may listen on the same
    address (replicas on purpose).
    """

    def __init__(self, app: App, address: str, *, http: str = "", reuse_port: bool = False) -> None:
        self.app = app
        self._reuse_port = reuse_port
        # What start_server holds for this server's life (the home's lock), released by stop.
        self.home_lock: HomeLock | None = None
        # Decided before any thread starts, so a refused address leaves nothing running.
        credentials = listen_credentials(app.config, address)
        self.tls = credentials is not None
        self.dashboard: HttpFrontEnd | None = None
        if http:
            self.dashboard = http_plugin(http)(app, http)  # binds: a taken port fails here
        try:
            self._start_loop(address, credentials)
        except BaseException:
            if self.dashboard is not None:
                self.dashboard.stop()
            raise

    def _start_loop(self, address: str, credentials: grpc.ServerCredentials | None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="skiff-loop", daemon=True
        )
        self._thread.start()
        self._pool = futures.ThreadPoolExecutor(WORKERS, thread_name_prefix="skiff-rpc")
        self._stopped = threading.Event()
        self._server, self.port = self._call(self._build(address, credentials))
        self._background = _background(self.app, self._publish_health)

    def _call(self, coro, timeout: float | None = 30):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def _publish_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING
        if not serving:
            status = health_pb2.HealthCheckResponse.NOT_SERVING

        async def publish() -> None:
            for name in self._health_names:
                await self._health.set(name, status)

        self._call(publish(), timeout=10)

    async def _build(
        self, address: str, credentials: grpc.ServerCredentials | None
    ) -> tuple[grpc.aio.Server, int]:
        self.auth = auth = Authenticator(self.app.store)
        server = grpc.aio.server(
            migration_thread_pool=self._pool,
            options=_options(reuse_port=self._reuse_port),
            interceptors=[AccessInterceptor(auth)],
            # Device Watch streams count: the default leaves room for a large fleet.
            maximum_concurrent_rpcs=self.app.config.max_concurrent_rpcs or None,
        )
        self._health, self._health_names = await _add_services(server, self.app, auth)
        try:
            if credentials is None:
                port = server.add_insecure_port(address)
            else:
                port = server.add_secure_port(address, credentials)
        except RuntimeError:  # "Failed to bind": gRPC does not say why
            port = 0
        if port == 0:
            raise listen_failure(address, reuse_port=self._reuse_port)
        return server, port

    def start(self) -> ServerHandle:
        """Start serving (and the feed, writer, watchers and scheduler behind it)."""
        self.app.feed.start()
        self.app.writer.start()
        self._call(self.app.watchers.start())
        self._call(self._server.start())
        for task in self._background:
            task.start()
        if self.dashboard is not None:
            self.dashboard.start()
        return self

    def _drain_pool(self, timeout: float) -> None:
        """Let the handler threads finish while the loop still runs, for at most `timeout`.

        A blocking handler that aborts or answers does so through the loop (grpc waits on
        a future the loop completes): stopping the loop first would leave that thread
        waiting for ever, and the interpreter, which joins pool threads at exit, with it.
        """
        drain = threading.Thread(
            target=self._pool.shutdown,
            kwargs={"wait": True, "cancel_futures": True},
            name="skiff-drain",
            daemon=True,
        )
        drain.start()
        drain.join(timeout)
        if drain.is_alive():
            log.warning("handler threads still busy %g s after stop", timeout)

    def stop(self, grace: float | None = None) -> threading.Event:
        """Stop serving, let in-flight calls finish for `grace` seconds, release everything.

        Returns an event that is already set (kept for `server.stop(...).wait()` callers).
        """
        if not self._stopped.is_set():
            if self.dashboard is not None:
                self.dashboard.stop()
            stop_all(self._background)
            self._call(self._server.stop(grace), timeout=None)
            self._call(self.app.watchers.stop())
            self.app.writer.close()
            self.app.telemetry.close()
            self.app.feed.close()
            self._drain_pool(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=5)
            if self.home_lock is not None:
                self.home_lock.release()
            self._stopped.set()
        return self._stopped


def db_description(url: str) -> str:
    """Return a database URL fit for the server's log: no password, no query string."""
    try:
        return sa_url.make_url(url).set(query={}).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - a malformed URL fails elsewhere, with its reason
        return "the configured database"


def _methods(*services) -> list[str]:
    return [f"/{s.full_name}/{m.name}" for s in services for m in s.methods]


def _background(app: App, publish_health) -> list[Periodic]:
    """Return the health monitor's timer and, unless switched off, the garbage sweep's."""
    monitor = HealthMonitor(
        {"database": app.store.check, "blob store": app.registry.blobs.check}, publish_health
    )
    tasks = [
        Periodic("health", app.config.health_interval_s, monitor.check),
        Periodic("rollup", app.config.rollup_interval_s, app.roller.tick),
        Periodic("guardrails", app.config.guard_interval_s, app.guard.check),
        # Advances rollouts whose stage has baked (safe on every replica).
        Periodic(
            "rollout scheduler",
            app.config.scheduler_interval_s,
            partial(app.rollouts.advance_due, ready=app.guard.ready),
            at_once=False,
        ),
    ]
    if app.config.gc_interval_s > 0:
        # Safe on every replica at once (registry/gc.py); each sweep lists the whole store.
        tasks.append(Periodic("gc", app.config.gc_interval_s, app.registry.collect_garbage))
    return tasks


async def _add_services(
    server: grpc.aio.Server, app: App, auth: Authenticator
) -> tuple[object, tuple[str, ...]]:
    """Register every service; returns the health servicer and the names it reports on."""
    admin_pb2_grpc.add_AdminServiceServicer_to_server(
        AdminServicer(
            app.registry,
            ApiTokens(app.store),
            auth,
            kek_rotation=kek_rotation(app.config, app.registry),
            upload_idle_timeout_s=app.config.upload_idle_timeout_s,
        ),
        server,
    )
    fleet_pb2_grpc.add_FleetServiceServicer_to_server(
        FleetServicer(app.view, app.recommendations, app.store), server
    )
    fleet_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(app.ops), server)
    device_pb2_grpc.add_DeviceServiceServicer_to_server(
        DeviceServicer(
            fleet=app.fleet,
            store=app.store,
            delivery=app.delivery,
            watchers=app.watchers,
            writer=app.writer,
            signing_keys=app.registry.signer,
            poll_interval_s=app.config.poll_interval_s,
            telemetry=app.telemetry,
            recommendations=app.recommendations,
            enroll_throttle=app.enroll_throttle,
        ),
        server,
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    services = [
        admin_pb2.DESCRIPTOR.services_by_name["AdminService"],
        fleet_pb2.DESCRIPTOR.services_by_name["FleetService"],
        fleet_pb2.DESCRIPTOR.services_by_name["RolloutService"],
        device_pb2.DESCRIPTOR.services_by_name["DeviceService"],
        health_pb2.DESCRIPTOR.services_by_name["Health"],
    ]
    check_table(_methods(*services))
    names = [s.full_name for s in services[:-1]]
    reflection.enable_server_reflection(
        (
            *names,
            health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
            reflection.SERVICE_NAME,
        ),
        server,
    )
    for name in ("", *names):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return health_servicer, ("", *names)


def create_server(
    config: Config, app: App, address: str, *, http: str | None = None, reuse_port: bool = False
) -> tuple[ServerHandle, int]:
    """Build (not start) a server for `app` on `address`; returns it with the bound port.

    `http` (default: the `http` setting) also serves the dashboard there; its bound port
    is `handle.dashboard.port`. `reuse_port` lets replicas share the address.
    """
    http = config.http if http is None else http
    handle = ServerHandle(app, address, http=http, reuse_port=reuse_port)
    return handle, handle.port


def start_server(
    *,
    config: Config,
    address: str | None = None,
    http: str | None = None,
    replica: bool = False,
    worker: int | None = None,
) -> tuple[ServerHandle, int]:
    """Build the app and a started server (and dashboard, per `http` or the config).

    The server holds its home (HomeLock) until it stops: a second one on the same home is
    refused, unless every server of the home is a `replica` (PostgreSQL only), and
    replicas may share their address too. A `worker` (its index) is one of the processes
    of `skiff server --workers N` (serve_workers): its supervisor holds the home's lock
    and the port, the worker shares both; only worker 0 serves the dashboard.
    """
    address = address or config.grpc
    if worker is not None:
        replica = True
        http = (config.http if http is None else http) if worker == 0 else ""
    if replica and sa_url.make_url(config.db).get_backend_name() != "postgresql":
        raise errors.InvalidArgument(
            "--replica needs a PostgreSQL database (--db): replicas hear each other's "
            "changes through it, and SQLite has no way to tell them"
        )
    listen_credentials(config, address)  # a refused address fails before the database opens
    http = config.http if http is None else http
    if http:
        http_plugin(http)  # and so does a dashboard this install lacks
    lock = HomeLock(config.home, shared=replica)
    if worker is None:
        lock.acquire()
    try:
        check_listen(address, reuse_port=replica)
        one_blas_thread()  # the guard's and roller's small products, not BLAS's pool
        app = build_app(config)
        try:
            server, port = create_server(config, app, address, http=http, reuse_port=replica)
        except BaseException:
            app.store.close()
            raise
    except BaseException:
        lock.release()
        raise
    server.home_lock = lock
    lock.describe(f"{address.rsplit(':', 1)[0]}:{port}")
    try:
        server.start()
    except BaseException:
        lock.release()  # whatever did start, this home is not served
        raise
    log.info("skiff control plane listening on port %d", port)
    if not app.store.has_admin_token(now=dt.datetime.now(dt.UTC)):
        log.warning("%s", no_admin_hint(db_description(config.db)))
    return server, port


# In-flight calls get STOP_GRACE_S to finish after SIGTERM; everything else STOP_LIMIT_S more.
STOP_GRACE_S = 10
STOP_LIMIT_S = 15
SIGNAL_POLL_S = 0.5


def serve(
    *,
    config: Config,
    replica: bool = False,
    workers: int | None = None,
    worker_index: int | None = None,
) -> int:
    """Run the server until SIGINT/SIGTERM, then drain in-flight calls; returns exit status.

    `workers` server processes (default: one per core with PostgreSQL, one with SQLite)
    share the --grpc port: see serve_workers. `worker_index` runs one of them.
    """
    # A worker whose supervisor dies (kill -9) stops too: nothing would hold the home's
    # lock or the port's reservation for it any more. (Before its "listening" line, the
    # supervisor's end of its stdout is gone and that print fails.)
    supervisor = os.getppid() if worker_index is not None else None
    if worker_index is not None:
        check_worker(worker_index)
    else:
        count = worker_count(config, workers)
        if count > 1:
            return serve_workers(
                config=config,
                count=count,
                replica=replica,
                stop_limit_s=STOP_GRACE_S + STOP_LIMIT_S + 5,
                poll_s=SIGNAL_POLL_S,
            )
    # It holds plaintext models and keys: no core file, no ptrace by same-user processes.
    forbid_core_dumps()
    server, port = start_server(config=config, replica=replica, worker=worker_index)
    # Before "listening" is printed: whoever waits for that line may stop us at once, and
    # a SIGTERM before the handler is in place would kill the server without its drain.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    objects_so_far_kept()  # the app as built lives as long as this process
    host = config.grpc.rsplit(":", 1)[0]
    transport = "TLS" if server.tls else "plaintext, this machine only"
    lines = [f"skiff server listening on {host}:{port} ({transport}; home {config.home})"]
    if server.dashboard is not None:
        lines.append(f"dashboard and /metrics at {server.dashboard.url}")
    if worker_index is not None:  # its supervisor reads up to the "listening" line
        lines.reverse()
    print(*lines, sep="\n", flush=True)
    # Woken every so often: a signal delivered to another thread (grpc's, the loop's) only
    # sets a flag the main thread reads when it runs, and an Event.wait() with no timeout
    # would never run it; such a SIGTERM was lost and the server kept serving.
    while not stop.wait(SIGNAL_POLL_S):
        if supervisor is not None and os.getppid() != supervisor:
            log.error("the supervisor of server worker %d is gone; stopping", worker_index)
            break
    # A stop that hangs (a handler thread that never returns, a grpc shutdown stuck on a
    # cancelled stream) must not leave a server that ignores SIGTERM: past the limit, the
    # stacks of every thread go to the log, for the report, and the process exits 1.
    faulthandler.dump_traceback_later(STOP_GRACE_S + STOP_LIMIT_S, exit=True)
    server.stop(grace=STOP_GRACE_S)
    server.app.store.close()
    return 0
