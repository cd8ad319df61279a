"""`skiff server --http`: the dashboard beside gRPC, in the real process users run."""

from __future__ import annotations

import signal

import requests

from tests.control_plane.cli.test_cli import skiff
from tests.control_plane.helpers import spawn_server


def test_server_http_serves_the_dashboard_over_tls(tmp_path):
    home = tmp_path / "home"
    skiff("init", "--home", str(home))
    proc, _ = spawn_server(home, "--http", "127.0.0.1:0")
    try:
        line = proc.stdout.readline()
        assert line.startswith("dashboard and /metrics at https://127.0.0.1:"), line
        url = line.split(" at ")[1].strip()
        s = requests.Session()
        s.trust_env, s.verify = False, str(home / "tls" / "ca.pem")
        assert s.get(url + "healthz").json() == {"ok": True}
        r = s.get(url, allow_redirects=False)
        assert r.status_code == 302 and r.headers["Location"].startswith("/login")
        token = (home / "admin.token").read_text().strip()
        r = s.post(url + "login", data={"token": token})
        assert r.status_code == 200 and 'id="devices-total">0<' in r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_a_taken_http_port_fails_the_start_with_one_line(tmp_path):
    home = tmp_path / "home"
    skiff("init", "--home", str(home))
    proc, _ = spawn_server(home, "--http", "127.0.0.1:0")
    try:
        port = proc.stdout.readline().rsplit(":", 1)[1].strip(" /\n")
        other = tmp_path / "other"  # the first server holds `home`: a second is refused
        skiff("init", "--home", str(other))
        again = skiff(
            "server",
            "--home",
            str(other),
            "--grpc",
            "127.0.0.1:0",
            "--http",
            f"127.0.0.1:{port}",
            check=False,
            timeout=60,
        )
        assert again.returncode == 6, again.stderr
        assert f"cannot serve the dashboard on 127.0.0.1:{port}" in again.stderr.splitlines()[-1]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
