"""Serves the dashboard (and /metrics) over HTTP(S) on a thread pool of its own.

cheroot (CherryPy's WSGI server) carries it: threads, because every page reads the
database with blocking calls, and its own port, so a slow page never holds up the gRPC
event loop the devices depend on. TLS with the gRPC server's certificate whenever one is
configured; plaintext only on loopback, as for gRPC.

A plug-in of the control plane: `control_plane.serve` finds `start` through the
`skiff.http` entry point (pyproject.toml) when asked for `--http`, so the control plane
never imports this package and installs without it. Flask and Plotly load with this
module, so an install without them fails `--http` before anything serves.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from cheroot import wsgi
from cheroot.ssl.builtin import BuiltinSSLAdapter

from contract import errors
from contract.transport import host_of, is_loopback
from dashboards.metrics import Metrics
from dashboards.web.app import create_app

if TYPE_CHECKING:
    from control_plane.api.throttle import Throttle
    from control_plane.app import App

log = logging.getLogger(__name__)

THREADS = 8


def _split(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise errors.InvalidArgument(f"--http {address!r:.80}: use HOST:PORT, e.g. 127.0.0.1:8080")
    return host_of(address), int(port)


class DashboardServer:
    """The dashboard on `address`; `port` is the one bound (tests pass port 0).

    `throttle` counts failed logins (default: control_plane.api.throttle's limits).
    """

    def __init__(self, app: App, address: str, *, throttle: Throttle | None = None) -> None:
        config = app.config
        host, port = _split(address)
        self.tls = bool(config.tls_cert and config.tls_key)
        if not self.tls and not is_loopback(address):
            raise errors.InvalidArgument(
                f"refusing to serve the dashboard on {address} without TLS: the login "
                "token and session cookie would cross the network in plaintext; set "
                "tls_cert and tls_key or listen on 127.0.0.1"
            )
        self.metrics = Metrics(app)
        web = create_app(app, secure_cookies=self.tls, metrics=self.metrics, throttle=throttle)
        self._server = wsgi.Server(
            (host, port),
            web,
            numthreads=THREADS,
            server_name="skiff-dashboard",
            request_queue_size=64,
            timeout=10,
        )
        if self.tls:
            self._server.ssl_adapter = BuiltinSSLAdapter(config.tls_cert, config.tls_key)
        try:
            self._server.prepare()  # binds now: a taken port fails here, not in a thread
        except OSError as exc:
            raise errors.Unavailable(f"cannot serve the dashboard on {address}: {exc}") from None
        self.host, self.port = host, self._server.bind_addr[1]
        self._thread = threading.Thread(
            target=self._server.serve, name="skiff-dashboard", daemon=True
        )

    @property
    def url(self) -> str:
        """Return the dashboard's address for people."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}/"

    def start(self) -> DashboardServer:
        """Start serving."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop accepting, finish the requests in flight."""
        self._server.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=10)


def start(app: App, address: str) -> DashboardServer:
    """Bind the dashboard for `app` to `address` (the `skiff.http` entry point's target)."""
    return DashboardServer(app, address)
