"""The CLI as operators and scripts meet it: whole ids in pipes, id prefixes, one JSON
shape for lists, defaults in --help, role errors in CLI words, usage errors, `rollout
wait` and `rollout show --watch`, and `skiff sim`'s live progress on a terminal only."""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import subprocess
import sys

import pytest

from contract import errors
from control_plane.cli import render, rollout_watch
from control_plane.cli.main import build_parser, error_message, main
from control_plane.id_prefix import only_match
from control_plane.sim.display import render as render_sim
from control_plane.sim.stats import FleetStats
from protos import fleet_pb2
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.cli.test_cli import (  # noqa: F401
    SKIFF,
    SKIFF_AT_A_TERMINAL,
    _error_line,
    ended,
    model_file,
    server,
    skiff,
)
from tests.control_plane.sim.conftest import cp_holder, template_home  # noqa: F401

LONG_ID = "dev_0123456789abcdef"


class FakeTerminal(io.StringIO):
    """What rich and the CLI take for a terminal: output the test can read back."""

    def isatty(self) -> bool:
        return True


def _table():
    from rich.table import Table

    table = Table()
    for col in ("ID", "NOTES"):
        table.add_column(col)
    table.add_row(LONG_ID, "a long note " * 8)
    return table


# -- ids are never cut ------------------------------------------------------------------


def test_piped_tables_are_plain_text_with_whole_ids():
    out = io.StringIO()  # not a terminal: a pipe or a file
    render.print_output(_table(), file=out)
    first, row = out.getvalue().splitlines()
    assert first.split() == ["ID", "NOTES"]
    assert row.startswith(LONG_ID + "  a long note")
    assert "\x1b" not in out.getvalue() and "…" not in out.getvalue()


def test_a_narrow_terminal_cuts_other_columns_never_the_id(monkeypatch):
    monkeypatch.setenv("COLUMNS", "30")
    out = FakeTerminal()
    render.print_output(_table(), file=out)
    assert LONG_ID in out.getvalue()


# -- unique prefixes ----------------------------------------------------------------------


def test_only_match_takes_a_unique_prefix_and_names_the_candidates_of_an_ambiguous_one():
    ids = ["ro_aa11", "ro_aa22", "ro_bb33"]
    assert only_match("rollout", "ro_b", ids) == "ro_bb33"
    assert only_match("rollout", "ro_aa22", ids) == "ro_aa22"
    with pytest.raises(errors.InvalidArgument, match=r"'ro_aa' .* \(ro_aa11, ro_aa22\)"):
        only_match("rollout", "ro_aa", ids)
    with pytest.raises(errors.NotFound, match="no rollout id starts with 'ro_cc'"):
        only_match("rollout", "ro_cc", ids)


# -- --help shows defaults --------------------------------------------------------------


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return " ".join(capsys.readouterr().out.split())  # unwrapped


@pytest.mark.parametrize(
    ("argv", "shown"),
    [
        (("rollout", "create"), ["--stages STAGES percentages, e.g. 1,10,50,100 (default: 100)"]),
        (("rollout", "create"), ["(0: only on promote) (default: 0)"]),
        (("server",), ["(SKIFF_GRPC; default: 127.0.0.1:7443)"]),
        (("rollout", "wait"), ["--interval S seconds between two reads of the rollout (default:"]),
        (("sim",), ["draws the devices' attributes (default: 0)", "(0: never; default 60s)"]),
        (("fleet", "ls"), ["(default 0: all of them"]),
    ],
)
def test_help_shows_defaults(capsys, argv, shown):
    text = _help(capsys, *argv)
    for words in shown:
        assert words in text


def test_help_never_prints_a_secret_from_the_environment(capsys, monkeypatch):
    monkeypatch.setenv("SKIFF_ENROLL_TOKEN", "skt_secret_enroll_value")
    monkeypatch.setenv("SKIFF_TOKEN", "skt_secret_admin_value")
    for argv in (("agent", "run"), ("model", "push"), ("rollout", "create")):
        assert "secret" not in _help(capsys, *argv)


def test_every_sub_parser_formats_its_help_the_same_way():
    def walk(parser):
        yield parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from walk(child)

    parsers = list(walk(build_parser()))
    assert len(parsers) > 30
    assert {type(p).__name__ for p in parsers} == {"SkiffParser"}


# -- role errors name the command ---------------------------------------------------------


def test_a_role_refusal_names_the_cli_command_not_the_rpc():
    refused = errors.PermissionDenied("token tok_1 (ci) is viewer; CreateRollout needs operator")
    args = argparse.Namespace(command="rollout", action="create")
    line = error_message(refused, args)
    assert line == "token tok_1 (ci) is viewer; `skiff rollout create` needs operator"
    other = errors.PermissionDenied("device revoked")
    assert error_message(other, args) == "device revoked"


# -- agent run usage ------------------------------------------------------------------------


def test_agent_run_without_identity_or_token_is_a_usage_error(tmp_path, capsys):
    code = main(["agent", "run", "--server", "127.0.0.1:1", "--state", str(tmp_path / "s")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [
        f"skiff: error: {tmp_path / 's'} holds no device identity: pass --enroll-token (or "
        "SKIFF_ENROLL_TOKEN) to enroll"
    ]


def test_agent_run_without_a_server_is_a_usage_error(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("SKIFF_AGENT_SERVER", raising=False)
    assert main(["agent", "run", "--state", str(tmp_path / "s"), "--enroll-token", "x"]) == 2
    assert "--server HOST:PORT" in capsys.readouterr().err


# -- rollout wait and --watch, on a scripted rollout ------------------------------------------


def _rollout(state: str = "active", stage: int = 1, stages=(50.0, 100.0)) -> fleet_pb2.Rollout:
    return fleet_pb2.Rollout(id="ro_0123456789", state=state, stage=stage, stages=list(stages))


class Script:
    """A rollout's readings in turn (the last one repeats), and a clock sleeps move."""

    def __init__(self, *readings: fleet_pb2.Rollout) -> None:
        self.readings, self.now, self.slept = list(readings), 0.0, []

    def get(self) -> fleet_pb2.Rollout:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_wait_returns_once_the_stage_is_reached():
    script = Script(_rollout(), _rollout(), _rollout(stage=2))
    seen = []
    done = rollout_watch.wait(
        script.get,
        rollout_watch.Goal(stage=2),
        on_change=seen.append,
        clock=script.clock,
        sleep=script.sleep,
        poll_s=0.5,
    )
    assert done.stage == 2 and script.slept == [0.5, 0.5]
    assert [r.stage for r in seen] == [1]  # the reading short of it, once


def test_wait_times_out_saying_where_the_rollout_is():
    script = Script(_rollout(state="paused"))
    with pytest.raises(rollout_watch.WaitTimedOut) as caught:
        rollout_watch.wait(
            script.get,
            rollout_watch.Goal(state="completed"),
            timeout_s=5,
            clock=script.clock,
            sleep=script.sleep,
            poll_s=2,
        )
    assert str(caught.value) == (
        "rollout ro_0123456789 did not reach state completed within 5s: it is paused at "
        "stage 1 of 2 (50%)"
    )
    assert script.slept == [2, 2, 1]


@pytest.mark.parametrize(
    ("reading", "goal", "words"),
    [
        (_rollout("rolled_back", 2), rollout_watch.Goal(), "it can never be completed"),
        (_rollout("rolled_back", 1), rollout_watch.Goal(stage=2), "will never reach stage 2"),
        (_rollout("completed", 2), rollout_watch.Goal(state="paused"), "can never be paused"),
    ],
)
def test_wait_stops_at_once_when_the_goal_is_out_of_reach(reading, goal, words):
    script = Script(reading)
    with pytest.raises(errors.FailedPrecondition, match=words):
        rollout_watch.wait(script.get, goal, clock=script.clock, sleep=script.sleep)
    assert script.slept == []


def test_wait_refuses_a_stage_the_rollout_does_not_have():
    with pytest.raises(errors.InvalidArgument, match="--stage 1 to 2"):
        rollout_watch.wait(lambda: _rollout(), rollout_watch.Goal(stage=3))


def test_watch_appends_one_plain_line_per_change_when_piped():
    script = Script(_rollout(), _rollout(), _rollout(stage=2), _rollout("completed", 2))
    out = io.StringIO()
    done = rollout_watch.watch(script.get, out=out, sleep=script.sleep, poll_s=1)
    lines = out.getvalue().splitlines()
    assert done.state == "completed" and len(lines) == 3
    assert lines[0].endswith(
        "ro_0123456789: active, stage 1 of 2 (50%); devices selected 0, "
        "in stage 0, synced 0, installed 0, failed 0"
    )
    assert "completed, stage 2 of 2 (100%)" in lines[2]
    assert "\x1b" not in out.getvalue()


def test_watch_json_prints_one_document_a_line():
    script = Script(_rollout(), _rollout("rolled_back"))
    out = io.StringIO()
    rollout_watch.watch(script.get, out=out, as_json=True, sleep=script.sleep)
    docs = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(d["state"], d["stage"]) for d in docs] == [("active", 1), ("rolled_back", 1)]


def test_watch_redraws_on_a_terminal_and_stops_cleanly_on_ctrl_c():
    out = FakeTerminal()
    readings = [_rollout(), _rollout(stage=2)]

    def get():
        if not readings:
            raise KeyboardInterrupt
        return readings.pop(0)

    with pytest.raises(KeyboardInterrupt):
        rollout_watch.watch(get, out=out, sleep=lambda s: None)
    drawn = out.getvalue()
    assert "stage 2 of 2 (100%)" in drawn and "Ctrl-C to stop watching" in drawn
    assert "\x1b[1A" in drawn  # the second reading was drawn over the first
    assert drawn.endswith("\x1b[?25h")  # the cursor is given back


# -- against a real server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def fleet(server, model_file):  # noqa: F811
    env = server["env"]
    skiff("model", "push", str(model_file), "--name", "ergo", env=env)
    token = skiff("token", "create", "--enroll", env=env).stdout.strip()
    address = env["SKIFF_SERVER"]
    devices = [
        Device.enroll(address, token, {"platform": "android", "tags": ["beta", "lab"]}),
        Device.enroll(address, token, {"platform": "android"}),
    ]
    return {"env": env, "devices": sorted(d.id for d in devices)}


@pytest.fixture
def cli(fleet, monkeypatch, capsys):
    """Run `skiff ARGS` in this process (stdout is no terminal); return (code, out, err)."""
    for key, value in fleet["env"].items():
        monkeypatch.setenv(key, value)

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def _ok(cli, *argv: str) -> str:
    code, out, err = cli(*argv)
    assert code == 0, err
    return out


def _one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def _create(cli, *args: str) -> str:
    return _ok(cli, "rollout", "create", "ergo:1", "--select", "platform=android", *args).strip()


def _first_difference(a: str, b: str) -> int:
    return next(i for i in range(min(len(a), len(b))) if a[i] != b[i])


def test_piped_fleet_ls_keeps_ids_whole_however_narrow(fleet):
    out = skiff("fleet", "ls", env={**fleet["env"], "COLUMNS": "20"}).stdout  # a real pipe
    for device_id in fleet["devices"]:
        assert f"\n{device_id}  " in out
    assert "\u2026" not in out


def test_device_ids_by_unique_prefix(fleet, cli):
    first, second = fleet["devices"]
    prefix = first[: _first_difference(first, second) + 1]
    assert json.loads(_ok(cli, "fleet", "show", prefix, "--json"))["id"] == first
    code, _, err = cli("fleet", "show", "dev_")
    line = _one_line(err)
    assert code == 3 and "'dev_' is the start of more than one device id" in line
    assert first in line and second in line
    code, _, err = cli("fleet", "show", "dev_zz")
    assert code == 4 and "no device id starts with 'dev_zz'" in _one_line(err)
    code, _, err = cli("fleet", "show", "nope")  # no device id can start so
    assert code == 3 and "invalid device id 'nope'" in _one_line(err)
    revoked = json.loads(_ok(cli, "fleet", "revoke", second[: len(prefix)], "--json"))
    assert revoked["id"] == second and revoked["revoked"] is True


def test_rollout_ids_by_unique_prefix(cli):
    rid = _create(cli, "--stages", "50,100")
    other = _create(cli)
    prefix = rid[: _first_difference(rid, other) + 1]
    assert json.loads(_ok(cli, "rollout", "show", prefix, "--json"))["id"] == rid
    _ok(cli, "rollout", "promote", prefix)
    assert json.loads(_ok(cli, "rollout", "show", rid, "--json"))["stage"] == 2
    code, _, err = cli("rollout", "show", "ro_")
    assert code == 3 and rid in _one_line(err) and other in _one_line(err)
    code, _, err = cli("rollout", "pause", "ro_zz")
    assert code == 4 and "no rollout id starts with 'ro_zz'" in _one_line(err)
    code, _, err = cli("rollout", "show", "nope")
    assert code == 3 and "invalid rollout id 'nope'" in _one_line(err)
    for each in (prefix, other):
        _ok(cli, "rollout", "rollback", each)


@pytest.mark.parametrize(
    ("argv", "key"),
    [
        (("fleet", "ls"), "devices"),
        (("rollout", "ls"), "rollouts"),
        (("model", "ls"), "models"),
        (("model", "show", "ergo"), "versions"),
        (("token", "ls"), "tokens"),
    ],
)
def test_every_list_is_one_json_shape(cli, argv, key):
    body = json.loads(_ok(cli, *argv, "--json"))
    assert {key, "more"} <= set(body) and isinstance(body[key], list)
    assert body["more"] is False


def test_fleet_show_prints_tags_as_text(fleet, cli):
    text = "".join(_ok(cli, "fleet", "show", d) for d in fleet["devices"])
    assert "tags=beta,lab" in text and "[" not in text


def test_a_viewer_is_told_which_command_needs_which_role(cli, monkeypatch):
    made = json.loads(_ok(cli, "token", "create", "--role", "viewer", "--name", "eyes", "--json"))
    monkeypatch.setenv("SKIFF_TOKEN", made["token"])
    code, _, err = cli("rollout", "create", "ergo:1")
    assert code == 5
    assert _one_line(err) == (
        f"skiff: error: token {made['id']} (eyes) is viewer; `skiff rollout create` needs operator"
    )


def _spawn(env: dict, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [*SKIFF_AT_A_TERMINAL, *args],
        env={**os.environ, **env, "PYTHONFAULTHANDLER": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _ended(process: subprocess.Popen) -> tuple[str, str]:
    return ended(process, what=" ".join(process.args[len(SKIFF_AT_A_TERMINAL) :]))


def test_rollout_wait_returns_when_a_promote_reaches_the_stage(fleet, cli):
    rid = _create(cli, "--stages", "50,100")
    waiting = _spawn(fleet["env"], "rollout", "wait", rid, "--stage", "2", "--interval", "0.1")
    try:
        said = waiting.stderr.readline()  # it has read the rollout: stage 1 of 2
        assert said.startswith(f"skiff: {rid}: active, stage 1 of 2 (50%)")
        assert said.rstrip().endswith("waiting for stage 2")
        _ok(cli, "rollout", "promote", rid)
        out, _ = _ended(waiting)
    finally:
        waiting.kill()
    assert waiting.returncode == 0
    assert out.startswith(f"{rid}: active, stage 2 of 2 (100%)")
    _ok(cli, "rollout", "rollback", rid)


def test_rollout_wait_exits_9_on_timeout_and_7_when_out_of_reach(cli):
    rid = _create(cli, "--stages", "50,100")
    code, out, err = cli("rollout", "wait", rid, "--timeout", "1s", "--interval", "0.2")
    assert code == 9 and out == ""
    assert err.splitlines()[-1] == (
        f"skiff: error: rollout {rid} did not reach state completed within 1s: it is active "
        "at stage 1 of 2 (50%)"
    )
    _ok(cli, "rollout", "rollback", rid)
    code, _, err = cli("rollout", "wait", rid, "--state", "completed")
    assert code == 7
    assert "is rolled_back at stage 1 of 2 (50%): it can never be completed" in _one_line(err)
    done = json.loads(_ok(cli, "rollout", "wait", rid, "--state", "rolled_back", "--json"))
    assert done["id"] == rid and done["state"] == "rolled_back"


def test_rollout_show_watch_appends_lines_when_piped_and_stops_when_finished(fleet, cli):
    rid = _create(cli, "--stages", "50,100")
    watching = _spawn(fleet["env"], "rollout", "show", rid, "--watch", "--interval", "0.1")
    try:
        assert "active, stage 1 of 2 (50%)" in watching.stdout.readline()
        _ok(cli, "rollout", "promote", rid)
        assert "active, stage 2 of 2 (100%)" in watching.stdout.readline()
        _ok(cli, "rollout", "rollback", rid)
        assert "rolled_back, stage 2 of 2 (100%)" in watching.stdout.readline()
        rest, err = _ended(watching)
    finally:
        watching.kill()
    assert watching.returncode == 0 and rest == "" and err == ""


def test_rollout_show_watch_ends_quietly_on_ctrl_c(fleet, cli):
    rid = _create(cli)
    watching = _spawn(fleet["env"], "rollout", "show", rid, "--watch", "--interval", "0.1")
    try:
        assert rid in watching.stdout.readline()
        watching.send_signal(signal.SIGINT)
        _, err = _ended(watching)
    finally:
        watching.kill()
    assert watching.returncode == 130 and "Traceback" not in err
    _ok(cli, "rollout", "rollback", rid)


# -- skiff sim: live progress on a terminal only -----------------------------------------------


def _sim(cp, *args: str) -> list[str]:
    return ["sim", "--home", str(cp.config.home), "--server", cp.address, *args]


def test_sim_draws_progress_on_a_terminal_and_stays_plain_when_piped(
    cp_holder,  # noqa: F811
    monkeypatch,
    capsys,
):
    cp = cp_holder["cp"]
    assert main(_sim(cp, "--devices", "4", "--once")) == 0
    out, err = capsys.readouterr()
    assert err == ""  # not a terminal: no progress at all
    assert "devices 4" in out and "\x1b" not in out  # the summary, plain

    terminal = FakeTerminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(_sim(cp, "--devices", "3", "--once")) == 0
    drawn = terminal.getvalue()
    assert f"skiff sim -> {cp.address}" in drawn and "devices 3" in drawn
    assert "\x1b[?25l" in drawn  # rich's live display took the terminal, and gave it back:
    assert drawn.endswith("\x1b[?25h\n") or drawn.rstrip("\n").endswith("\x1b[?25h")
    capsys.readouterr()

    terminal.seek(0)
    terminal.truncate()
    assert main(_sim(cp, "--devices", "2", "--once", "--json")) == 0
    assert terminal.getvalue() == ""  # --json: quiet
    assert json.loads(capsys.readouterr().out)["summary"]["devices"] == 2


def test_sim_progress_counts_the_devices_still_enrolling():
    stats = FleetStats(
        devices=0,
        watching=0,
        synced=0,
        converged=0,
        rejected=0,
        syncs=0,
        reconnects=0,
        downloads=0,
        bytes_downloaded=0,
        enrolling=1200,
    )
    text = render.plain_text(render_sim(stats, title="skiff sim -> x"))
    assert "enrolling: 1,200 devices to go" in text
