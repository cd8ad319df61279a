"""How the store connects: what each backend's connections are set up with."""

from __future__ import annotations

import os
import socket

import pytest

from control_plane.store.sql_store import PG_CONNECT, make_engine

pytestmark = pytest.mark.postgres


def _tcp_options(engine) -> dict[str, int]:
    """Return the keepalive settings of one of `engine`'s connections, read off its socket."""
    with engine.connect() as conn:
        fd = os.dup(conn.connection.dbapi_connection.fileno())
    with socket.socket(fileno=fd) as sock:
        return {
            "keepalives": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "keepalives_idle": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
            "keepalives_interval": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
            "keepalives_count": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
            "tcp_user_timeout": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
        }


def test_a_postgresql_server_that_goes_silent_fails_the_query_within_seconds(pg_url):
    # Probed when idle (a query waiting on its answer is idle on the wire), and a query
    # whose bytes the server never acknowledges is given up after 30 s: not the kernel's
    # default of two hours of silence before the first probe.
    engine = make_engine(pg_url)
    try:
        options = _tcp_options(engine)
    finally:
        engine.dispose()
    assert options == {k: v for k, v in PG_CONNECT.items() if k != "connect_timeout"}
    assert options["keepalives_idle"] + options["keepalives_interval"] * 3 <= 30


def test_settings_in_the_database_url_win(pg_url):
    engine = make_engine(f"{pg_url}?keepalives_idle=42&tcp_user_timeout=9000")
    try:
        options = _tcp_options(engine)
    finally:
        engine.dispose()
    assert options["keepalives_idle"] == 42 and options["tcp_user_timeout"] == 9000
    assert options["keepalives_interval"] == PG_CONNECT["keepalives_interval"]
