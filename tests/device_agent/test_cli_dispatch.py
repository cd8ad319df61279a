"""The `skiff` script: device commands here, operator commands through the entry point."""

from __future__ import annotations

import pytest

from control_plane.cli.main import build_parser
from device_agent import cli

REFUSAL = "skiff: 'skiff model' is an operator command, and this install has the device side only"


def test_the_operator_command_list_matches_the_operators_parser():
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    assert set(sub.choices) - cli.DEVICE_COMMANDS == cli.OPERATOR_COMMANDS


@pytest.fixture
def device_only(monkeypatch):
    monkeypatch.setattr(cli, "operator_refusal", lambda command: REFUSAL)


def test_an_operator_command_on_a_device_says_which_extra(device_only, capsys):
    assert cli.main(["model", "ls"]) == 2
    assert capsys.readouterr().err.strip() == REFUSAL


def test_a_typo_on_a_device_is_not_told_to_install_the_server(device_only, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["agnet", "run"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'agnet'" in err and "pip install" not in err.splitlines()[-1]


def test_bare_skiff_on_a_device_shows_the_device_help_naming_the_extra(device_only, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "agent" in out and "pip install 'skiff[server]'" in out


def test_version_says_which_sides_are_installed(monkeypatch, capsys):
    import contract.extras

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip().endswith("(device and server sides)")
    monkeypatch.setattr(contract.extras, "missing_requirements", lambda extra: ["sqlalchemy"])
    monkeypatch.setattr(cli, "operator_refusal", lambda command: REFUSAL)
    with pytest.raises(SystemExit):
        cli.main(["--version"])
    assert capsys.readouterr().out.strip().endswith("(device side)")
