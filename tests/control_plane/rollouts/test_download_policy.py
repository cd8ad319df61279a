"""A rollout's download policy: devices wait for Wi-Fi or a charger, counted as waiting.

Over real gRPC and the real CLI: a device on a cellular network, or on battery, is not
assigned the version (nor sent its key) while the rollout says to wait; `rollout show`
counts it as waiting with its reason, not as failed; once a Sync reports conditions that
allow the download, it gets the version.
"""

from __future__ import annotations

import json

import pytest

from contract import errors
from control_plane.demo import sample_models
from control_plane.rollouts.download_policy import CHARGING, WIFI, check, waits
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.cli.test_cli import _error_line, skiff
from tests.control_plane.helpers import start_control_plane


@pytest.mark.parametrize(
    ("on", "during", "custom", "reason"),
    [
        ("wifi", "any", {"network": "cellular"}, WIFI),
        ("wifi", "any", {"network": "none"}, WIFI),
        ("wifi", "any", {"network": "wifi"}, None),
        ("wifi", "any", {"network": "ethernet"}, None),  # unmetered too
        ("any", "any", {"network": "cellular", "charging": "no"}, None),
        ("any", "charging", {"charging": "no"}, CHARGING),
        ("any", "charging", {"charging": "yes"}, None),
        ("wifi", "charging", {"network": "wifi", "charging": "no"}, CHARGING),
        ("wifi", "charging", {}, None),  # what a device does not say does not hold it back
    ],
)
def test_waits_names_what_the_device_waits_for(on, during, custom, reason):
    found = waits(on, during, {"custom": custom})
    assert (found[0] if found else None) == reason, found


def test_a_policy_is_checked_and_defaults_to_any():
    assert check("", "") == ("any", "any")
    with pytest.raises(errors.InvalidArgument, match="--download-on must be one of any, wifi"):
        check("cellular", "")
    with pytest.raises(errors.InvalidArgument, match="--download-while must be one of"):
        check("any", "plugged")


def test_devices_wait_for_wifi_and_a_charger_then_get_the_version(tmp_path):
    cp = start_control_plane(tmp_path / "home")
    env = {"SKIFF_HOME": str(cp.config.home), "SKIFF_SERVER": cp.address, "SKIFF_TOKEN": ""}
    try:
        onnx = tmp_path / "det.onnx"
        onnx.write_bytes(sample_models.tiny_mlp_onnx(seed=8))
        skiff("model", "push", str(onnx), "--name", "det", env=env)
        with cp.client() as client:
            token = client.create_enrollment_token(uses=0).token
        linux = {"platform": "linux"}
        phone = Device.enroll(
            cp.address, token, {**linux, "custom": {"network": "cellular", "charging": "yes"}}
        )
        unplugged = Device.enroll(
            cp.address, token, {**linux, "custom": {"network": "wifi", "charging": "no"}}
        )
        ready = Device.enroll(
            cp.address, token, {**linux, "custom": {"network": "ethernet", "charging": "yes"}}
        )
        old_agent = Device.enroll(cp.address, token, dict(linux))  # says neither
        bad = skiff("rollout", "create", "det:1", "--download-on", "lte", env=env, check=False)
        assert bad.returncode != 0
        assert "--download-on must be one of any, wifi" in _error_line(bad)
        created = json.loads(
            skiff(
                "rollout",
                "create",
                "det:1",
                "--select",
                "platform=linux",
                "--download-on",
                "wifi",
                "--download-while",
                "charging",
                "--json",
                env=env,
            ).stdout
        )
        assert (created["download_on"], created["download_while"]) == ("wifi", "charging")
        assert phone.sync().models == {}  # no assignment, no key, until it may download
        assert unplugged.sync().models == {}
        assert list(ready.sync().models) == ["det"]
        assert list(old_agent.sync().models) == ["det"]
        shown = json.loads(skiff("rollout", "show", created["id"], "--json", env=env).stdout)
        counts = shown["counts"]
        assert counts["waiting"] == 2 and counts["waiting_reasons"] == {"charging": 1, "wifi": 1}
        assert counts["ineligible"] == 0 and counts["failed"] == 0
        assert counts["in_stage"] == 2
        text = skiff("rollout", "show", created["id"], env=env).stdout
        assert "waiting 2 (charging 1, wifi 1)" in text
        assert "downloads on wifi, while charging" in text
        # The phone reaches Wi-Fi: its next Sync gets the version.
        phone.attributes = {**linux, "custom": {"network": "wifi", "charging": "yes"}}
        assert list(phone.sync().models) == ["det"]
        counts = json.loads(skiff("rollout", "show", created["id"], "--json", env=env).stdout)[
            "counts"
        ]
        assert counts["waiting_reasons"] == {"charging": 1}
    finally:
        cp.stop()
