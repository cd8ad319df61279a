"""Device classes: what telemetry is grouped and rollouts are sliced by, as configured."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys

import pytest

from contract import errors
from control_plane.store.rollup_records import RollupKey
from control_plane.telemetry.classes import class_values, parse_device_class
from control_plane.telemetry.roller import HOUR, Retention, Roller
from tests.control_plane.telemetry.test_rollups import (
    NOW,
    FixedResolver,
    enroll,
    fleet_wide,
    report,
    stats,
)


def test_a_configured_class_groups_by_its_own_attributes():
    cls = parse_device_class(" platform , app_version:major,custom.carrier ")
    assert str(cls) == "platform,app_version:major,custom.carrier"
    attrs = {"platform": "android", "app_version": "5.3.1", "custom": {"carrier": "acme"}}
    assert class_values(cls.of(attrs)) == {
        "platform": "android",
        "app_version": "5",
        "custom.carrier": "acme",
    }
    assert class_values(cls.of({})) == {"platform": "", "app_version": "", "custom.carrier": ""}


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("soc,colour", "unknown attribute 'colour'"),
        ("soc:major", "only os_version and app_version take ':major'"),
        ("os_version:minor", "only os_version and app_version take ':major'"),
        ("soc,soc", "'soc' is listed twice"),
        ("", "needs 1 to 6 attributes"),
        ("platform,soc,region,device_model,os_version,app_version,custom.x", "1 to 6"),
    ],
)
def test_a_bad_class_is_refused_naming_the_part(text, fragment):
    with pytest.raises(errors.InvalidArgument, match=fragment):
        parse_device_class(text)


def test_the_roller_keeps_what_the_setting_and_retention_say(db_url):
    """A class of `platform` alone merges two SoCs into one row; hour rows older than the
    configured retention are not even written."""
    from control_plane.store.sql_store import SqlStore

    store = SqlStore(db_url)
    try:
        a = enroll(store, platform="android", soc="sm8450")
        b = enroll(store, platform="android", soc="sm8650")
        report(store, a, "batch-a-0001", stats(1, [100.0] * 3))
        report(store, b, "batch-b-0001", stats(1, [200.0] * 5))
        old = NOW - dt.timedelta(hours=5)
        report(store, b, "batch-b-0002", stats(1, [300.0] * 7), at=old)
        roller = Roller(
            store,
            FixedResolver(),
            parse_device_class("platform"),
            retention=Retention(minute=dt.timedelta(hours=1), hour=dt.timedelta(hours=3)),
            clock=lambda: NOW + dt.timedelta(seconds=1),
            straggler_age=dt.timedelta(0),
        )
        assert roller.roll() == 3
        rows = fleet_wide(store, HOUR)
        ((key, agg),) = rows.items()
        assert isinstance(key, RollupKey) and class_values(key.device_class) == {
            "platform": "android"
        }
        assert agg.latency_count == 8  # the 5-hour-old batch is past the 3-hour retention
    finally:
        store.close()


def test_a_server_with_a_bad_class_setting_does_not_start(tmp_path):
    home = tmp_path / "home"
    cli = [sys.executable, "-m", "control_plane.cli"]
    subprocess.run([*cli, "init", "--home", str(home)], check=True, capture_output=True)
    done = subprocess.run(
        [*cli, "server", "--home", str(home), "--grpc", "127.0.0.1:0"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "SKIFF_DEVICE_CLASS": "soc,colour"},
    )
    assert done.returncode == 3, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "unknown attribute 'colour'" in line
