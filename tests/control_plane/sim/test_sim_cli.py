"""`skiff sim` as users run it: --once --json, --state reuse, errors, Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import stat
import subprocess
import sys
import time

from control_plane.cli.fleet_views import device_dict
from control_plane.cli.main import main
from control_plane.sim.profile import load_profile
from protos import fleet_pb2
from tests.control_plane.sim.conftest import MODEL, wait_for


def sim(cp, *args: str) -> list[str]:
    return ["sim", "--home", str(cp.config.home), "--server", cp.address, *args]


def run_json(capsys, argv: list[str]) -> dict:
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # stdout holds the document and nothing else


def rollout(cp, version: int, selector: str, stages=(100,), bake_s: int = 0):
    request = fleet_pb2.CreateRolloutRequest(
        model=MODEL,
        version=version,
        selector=selector,
        stages=list(stages),
        bake_s=bake_s,
        allow_empty=True,  # made before the simulated fleet enrolls
    )
    with cp.client() as client:
        return client.create_rollout(request)


def test_once_json_lists_every_device_with_what_the_server_wants(cp_holder, capsys):
    cp = cp_holder["cp"]
    rollout(cp, 1, "platform=android")
    rollout(cp, 2, "platform=ios")
    doc = run_json(capsys, sim(cp, "--devices", "40", "--seed", "7", "--once", "--json"))
    devices = doc["devices"]
    assert len(devices) == len({d["id"] for d in devices}) == 40
    expected = {"android": 1, "ios": 2}
    for d in devices:
        version = expected.get(d["attributes"]["platform"])
        if version is None:
            assert d["desired"] == {} and d["installed"] == {}
        else:
            assert d["desired"][MODEL]["version"] == version
            assert d["desired"][MODEL]["variant"] == "fp32"
            assert d["installed"] == {MODEL: {"version": version, "variant": "fp32"}}
    with cp.client() as client:
        server = {d.id: device_dict(d) for d in client.list_devices()}
    assert set(server) == {d["id"] for d in devices}
    for d in devices:
        assert d["desired"] == server[d["id"]]["desired"]  # the same shape as `fleet ls`
        assert d["installed"] == server[d["id"]]["installed"]  # reported by the re-Sync
    summary = doc["summary"]
    assert summary["devices"] == summary["enrolled"] == summary["synced"] == 40
    assert summary["failures"] == {} and summary["rejected"] == 0
    assert summary["downloads"] == 2  # one per distinct artifact, not one per device
    installed = sum(c["installed"] for c in summary["converged"].values())
    assert installed == sum(d["platform"] in expected for d in map(_attrs, devices))


def _attrs(device: dict) -> dict:
    return device["attributes"]


def test_state_file_keeps_identities_and_grows_to_n(cp_holder, capsys, tmp_path):
    cp = cp_holder["cp"]
    state = tmp_path / "fleet.json"
    first = run_json(capsys, sim(cp, "--devices", "10", "--state", str(state), "--once", "--json"))
    assert stat.S_IMODE(state.stat().st_mode) == 0o600
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".fleet.json")]  # no temp
    ids = [d["id"] for d in first["devices"]]
    secrets = state.read_text()
    assert all(d["credential"] in secrets for d in json.loads(secrets)["devices"])

    second = run_json(capsys, sim(cp, "--devices", "15", "--state", str(state), "--once", "--json"))
    assert [d["id"] for d in second["devices"]][:10] == ids
    assert second["summary"]["reused"] == 10 and second["summary"]["enrolled"] == 5
    assert [d["attributes"] for d in second["devices"]][:10] == [
        d["attributes"] for d in first["devices"]
    ]
    grown = [d["id"] for d in second["devices"]]

    third = run_json(capsys, sim(cp, "--devices", "4", "--state", str(state), "--once", "--json"))
    assert [d["id"] for d in third["devices"]] == ids[:4]
    assert [d["id"] for d in json.loads(state.read_text())["devices"]] == grown  # kept all 15
    with cp.client() as client:
        assert len(client.list_devices()) == 15  # nobody enrolled twice


def test_errors_are_one_line_with_exit_codes(cp_holder, capsys, tmp_path):
    cp = cp_holder["cp"]
    code = main(sim(cp, "--devices", "3", "--enroll-token", "ske_wrong", "--once", "--json"))
    out, err = capsys.readouterr()
    assert (code, out) == (5, "")
    assert err.startswith("skiff: error: enrollment refused: ") and err.count("\n") == 1

    # A state file from another control plane: every device is refused.
    state = tmp_path / "fleet.json"
    assert main(sim(cp, "--devices", "2", "--state", str(state), "--once")) == 0
    capsys.readouterr()
    doc = json.loads(state.read_text())
    for d in doc["devices"]:
        d["credential"] = "skd_" + "x" * 43
    state.write_text(json.dumps(doc))
    os.chmod(state, 0o600)
    code = main(sim(cp, "--devices", "2", "--state", str(state), "--once", "--json"))
    out, err = capsys.readouterr()
    assert (code, out) == (5, "")
    assert "refused every device in" in err and err.count("\n") == 1

    os.chmod(state, 0o644)  # it holds secrets: refuse a readable one, as ssh does
    assert main(sim(cp, "--devices", "2", "--state", str(state), "--once")) == 3
    assert "must not be accessible by group or others" in capsys.readouterr().err


def test_watching_fleet_converges_then_stops_cleanly_on_sigint(cp_holder, tmp_path):
    cp = cp_holder["cp"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "control_plane.cli", *sim(cp, "--devices", "25", "--json")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SKIFF_TOKEN": cp.token},
    )
    try:
        with cp.client() as client:
            wait_for(lambda: sum(d.online for d in client.list_devices()) == 25, what="25 watching")
            created = rollout(cp, 1, "platform in (android, ios)")
            started = time.monotonic()
            counts = wait_for(
                lambda: (c := client.get_rollout(created.id).counts).installed == c.selected and c,
                what="the rollout to be installed",
            )
        assert counts.selected > 0 and counts.synced == counts.selected
        assert time.monotonic() - started < 10  # pushed over Watch, not the 300 s poll
    finally:
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    doc = json.loads(out)
    assert doc["summary"]["devices"] == 25 and doc["summary"]["failures"] == {}
    chosen = [d for d in doc["devices"] if d["attributes"]["platform"] in ("android", "ios")]
    assert len(chosen) == counts.selected
    assert all(d["installed"] == {MODEL: {"version": 1, "variant": "fp32"}} for d in chosen)


def test_duration_run_ends_on_its_own_with_streams_open(cp_holder, capsys):
    cp = cp_holder["cp"]
    rollout(cp, 2, "")
    started = time.monotonic()
    doc = run_json(capsys, sim(cp, "--devices", "6", "--duration", "1s", "--json"))
    assert 1.0 <= time.monotonic() - started < 10
    summary = doc["summary"]
    assert summary["watching"] == 6  # counted before the streams were cancelled
    assert summary["converged_devices"] == 6
    assert summary["converged"] == {"det:2 (fp32)": {"desired": 6, "installed": 6}}


def test_text_summary_shows_convergence_per_version(cp_holder, capsys):
    cp = cp_holder["cp"]
    rollout(cp, 1, "platform=ios")
    assert main(sim(cp, "--devices", "12", "--seed", "3", "--once")) == 0
    out = capsys.readouterr().out
    ios = sum(load_profile().attributes(3, i)["platform"] == "ios" for i in range(12))
    assert ios > 0
    assert "devices 12  watching 0  synced 12  converged 12" in out
    assert re.search(rf"det:1 \(fp32\)\s+{ios}\s+{ios}\s+100%", out), out
