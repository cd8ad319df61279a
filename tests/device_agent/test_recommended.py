"""Backend recommendations reach real agents: the Sync answer carries the fleet's pick for
the device's class, the agent tries it first and its golden check decides."""

from __future__ import annotations

import datetime as dt

import numpy as np
import pytest

from contract import errors
from control_plane.cli.main import main
from control_plane.store.report_records import ModelStatsRecord, ReportBatch
from runtime.histogram import LatencyHistogram
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.sim.test_sim_cli import run_json
from tests.control_plane.telemetry.test_rollups import enroll
from tests.device_agent.conftest import MODEL
from tests.device_agent.test_agent import rollout, run_agent_cli, status, token

CLASS = {"soc": "sm8650", "device_model": "Pixel 8", "os_version": "14.2"}
FAST, SLOW = "CPU/normal/t2/mem-normal", "CPU/normal/t1/mem-normal"


def stats(n: int, config: str, median_us: float, crashes: int = 0) -> ModelStatsRecord:
    h = LatencyHistogram()
    h.record_many_ns(np.random.default_rng(n).lognormal(np.log(median_us), 0.2, n) * 1000)
    crash = {"at": "x", "config": config, "reason": "signal", "signal": "SIGSEGV"}
    return ModelStatsRecord(
        MODEL, 1, "fp32", config, n, 0, 0, h.to_dict(), crashes=(crash,) * crashes
    )


def report(cp, device: str, *entries: ModelStatsRecord) -> None:
    """One batch of the last minute, as the Report RPC stores it (periods checked)."""
    now = dt.datetime.now(dt.UTC)
    start = now - dt.timedelta(minutes=1)
    batch = ReportBatch(device, f"b-{device[-12:]}", now, start, now, 0, entries, ())
    assert cp.app.telemetry.report(batch).result(10)


def test_the_fleets_pick_is_sent_tried_first_and_checked(cp, tmp_path, capsys, monkeypatch):
    rollout(cp, 1)
    store = cp.app.store
    for _ in range(5):
        report(cp, enroll(store, **CLASS), stats(600, FAST, 800), stats(900, SLOW, 2500))
    for _ in range(5):  # another class: its figures do not count here
        report(cp, enroll(store, soc="mt6789"), stats(2000, SLOW, 100))
    cp.app.roller.roll()

    with cp.client() as client:
        tables = client.get_backends(MODEL, 1).classes
    (mine,) = [t for t in tables if t.device_class["soc"] == "sm8650"]
    assert mine.device_class == {"soc": "sm8650", "device_model": "Pixel 8", "os_version": "14"}
    assert mine.recommended == FAST
    assert [c.config for c in mine.configs] == [FAST, SLOW]
    assert mine.configs[0].samples == 3000 and 700 < mine.configs[0].p50_us < 900
    assert mine.configs[0].devices == 5
    # The same table from the command line, for scripts and for people.
    show = ["model", "show", f"{MODEL}:1", "--backends", "--home", str(cp.config.home)]
    monkeypatch.setenv("SKIFF_SERVER", cp.address)
    doc = run_json(capsys, [*show, "--json"])
    (row,) = [t for t in doc["classes"] if t["device_class"]["soc"] == "sm8650"]
    assert row["recommended"] == FAST and row["configs"][0]["recommended"] is True
    assert row["configs"][1]["samples"] == 4500 and row["configs"][1]["eligible"] is True
    assert main(show) == 0
    text = capsys.readouterr().out
    assert f"* {FAST}" in text and "soc=sm8650" in text
    # The Sync answer of a device of that class carries the pick and its sample size; a
    # device of another class gets that class's, and one of a class nobody reported, none.
    assert _suggested(cp, CLASS) == (FAST, 3000)
    assert _suggested(cp, {"soc": "mt6789"}) == (SLOW, 10_000)
    assert _suggested(cp, {"soc": "a17pro"}) == ("", 0)

    state = tmp_path / "state"
    attrs = [a for k, v in CLASS.items() for a in ("--attr", f"{k}={v}")]
    run = run_agent_cli(cp, state, "--enroll-token", token(cp), *attrs)
    assert run.returncode == 0, run.stderr
    active = status(state)["models"][MODEL]["active"]
    assert active["config"] == FAST
    (tried,) = active["probes"]  # one golden check, not a probe of every candidate
    assert tried["config"] == FAST and tried["recommended"] and tried["accepted"]


def test_a_config_with_crashes_or_few_samples_is_not_recommended(cp):
    store = cp.app.store
    for _ in range(5):
        report(
            cp,
            enroll(store, **CLASS),
            stats(5000, FAST, 500, crashes=40),  # fastest, but crashes
            stats(300, SLOW, 900),  # too few samples: 300 left of 900
        )
    report(cp, enroll(store, **CLASS), stats(20_000, "CPU/low/t1/mem-low", 100))  # one device
    cp.app.roller.roll()
    (t,) = cp.app.recommendations.table(MODEL, 1)
    assert t.recommended is None
    assert [c.why for c in t.configs] == [
        "crash rate 0.008 > 0.001",
        "900 of 1000 samples (of 1500 reported; capped, outliers left out)",
        "1 of 5 devices",
    ]
    rollout(cp, 1)
    assert _suggested(cp, CLASS) == ("", 0)  # Sync suggests nothing: the device probes


def test_one_device_cannot_steer_its_classs_recommendation(cp):
    """The attack review's fourth reproduction: a device claiming to be a Pixel 8 reports a
    million fast samples on a config nobody else runs, and a million slow ones on the
    config the fleet's Pixel 8s run well. The fleet's pick stands."""
    store = cp.app.store
    for _ in range(5):
        report(cp, enroll(store, **CLASS), stats(900, FAST, 800), stats(900, SLOW, 2500))
    liar = enroll(store, **CLASS)
    forged = "CPU/low/t1/mem-low"
    report(cp, liar, stats(1_000_000, forged, 5), stats(1_000_000, FAST, 50_000))
    cp.app.roller.roll()
    (t,) = cp.app.recommendations.table(MODEL, 1)
    assert t.recommended == FAST
    figures = {c.config: c for c in t.configs}
    assert not figures[forged].eligible and figures[forged].why == "1 of 5 devices"
    assert figures[FAST].devices == 6 and figures[FAST].p50_us < 1000  # the liar left out


def _suggested(cp, attributes: dict) -> tuple[str, int]:
    """Enroll a device with `attributes`; return what its Sync answer recommends for det."""
    answer = Device.enroll(cp.address, token(cp), attributes).sync_raw()
    (assigned,) = [m for m in answer.models if m.model == MODEL]
    return assigned.recommended_config, assigned.recommended_samples


def test_a_recommendation_this_device_cannot_honour_falls_back_to_its_own_probe(cp, tmp_path):
    # OpenCL is fastest on the fleet's phones; this machine's MNN has CPU only.
    gpu = "OPENCL/normal/t4/mem-normal"
    rollout(cp, 1)
    for _ in range(5):
        report(cp, enroll(cp.app.store, **CLASS), stats(1500, gpu, 300))
    cp.app.roller.roll()
    state = tmp_path / "state"
    attrs = [a for k, v in CLASS.items() for a in ("--attr", f"{k}={v}")]
    run = run_agent_cli(cp, state, "--enroll-token", token(cp), *attrs)
    assert run.returncode == 0, run.stderr
    active = status(state)["models"][MODEL]["active"]
    assert active["config"].startswith("CPU/")
    probes = {p["config"]: p for p in active["probes"]}
    assert len(probes) > 2  # the full probe ran
    assert probes[gpu]["recommended"] and not probes[gpu]["accepted"]


def test_backends_refuse_bad_input_and_callers_without_a_token(cp):
    with cp.client() as client:
        for args, error, fragment in [
            (("../x", 1), errors.InvalidArgument, "name"),
            ((MODEL, 0), errors.InvalidArgument, "version must be 1"),
            ((MODEL, 1, "fp32; drop"), errors.InvalidArgument, "invalid variant"),
            (("nope", 1), errors.NotFound, "nope"),
        ]:
            with pytest.raises(error) as caught:
                client.get_backends(*args)
            assert fragment in str(caught.value)
        assert list(client.get_backends(MODEL, 1).classes) == []  # no telemetry yet
    with cp.client(token="skf_not-a-token") as stranger, pytest.raises(errors.Unauthenticated):
        stranger.get_backends(MODEL, 1)
