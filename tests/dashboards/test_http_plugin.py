"""The dashboard is a plug-in of the server: found by entry point, never imported by it."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import EntryPoint, entry_points

import pytest

from contract.command_line import UsageError
from control_plane import serve
from dashboards import server as dashboard_server
from tests.control_plane.cli.test_cli import skiff


def test_the_dashboard_is_registered_as_the_servers_http_front_end():
    found = {e.name: e for e in entry_points(group=serve.HTTP_ENTRY_POINTS)}
    assert found["dashboard"].value == "dashboards.server:start"
    assert serve.http_plugin("127.0.0.1:0") is dashboard_server.start


def test_the_control_plane_runs_without_importing_the_dashboard():
    code = (
        "import sys, control_plane.app, control_plane.serve, control_plane.cli.main; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dashboards'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("plugins", "says"),
    [
        ([], "this install has no dashboard"),
        (
            [EntryPoint("dashboard", "skiff_no_such_module:start", serve.HTTP_ENTRY_POINTS)],
            "the dashboard needs skiff_no_such_module",
        ),
    ],
)
def test_http_without_the_dashboard_names_the_extra(monkeypatch, plugins, says):
    monkeypatch.setattr(serve, "own_entry_points", lambda group: plugins)
    with pytest.raises(UsageError) as raised:
        serve.http_plugin("127.0.0.1:8080")
    message = str(raised.value)
    assert says in message and "pip install 'skiff[dashboard]'" in message
    assert "\n" not in message


def test_server_http_without_flask_fails_in_one_line_before_serving(tmp_path):
    home = tmp_path / "home"
    skiff("init", "--home", str(home))
    # As on an install without skiff[dashboard]: importing Flask fails.
    code = (
        "import runpy, sys; sys.modules['flask'] = None; "
        "sys.argv = ['skiff', 'server', '--home', sys.argv[1], '--grpc', '127.0.0.1:0', "
        "'--http', '127.0.0.1:0']; runpy.run_module('control_plane.cli', run_name='__main__')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(home)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "skiff: error: --http 127.0.0.1:0: the dashboard needs flask, which this install "
        "lacks; pip install 'skiff[dashboard]'"
    )
    assert "Traceback" not in done.stderr


def test_a_dashboard_that_fails_to_load_for_another_reason_is_one_line(monkeypatch, tmp_path):
    (tmp_path / "skiff_broken_dashboard.py").write_text("raise RuntimeError('half-installed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = [EntryPoint("dashboard", "skiff_broken_dashboard:start", serve.HTTP_ENTRY_POINTS)]
    monkeypatch.setattr(serve, "own_entry_points", lambda group: broken)
    with pytest.raises(UsageError) as raised:
        serve.http_plugin("127.0.0.1:8080")
    message = str(raised.value)
    assert "failed to load: RuntimeError: half-installed" in message and "\n" not in message
