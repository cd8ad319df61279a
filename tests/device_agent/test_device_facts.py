"""What the agent detects for download policies: its network and whether it is charging.

Read from sysfs; here over fake /sys/class/net and /sys/class/power_supply trees.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from device_agent.device_facts import _charging, _network, with_detected


def _iface(root: Path, name: str, *, up: bool = True, wireless: bool = False, uevent: str = ""):
    d = root / name
    d.mkdir(parents=True)
    (d / "operstate").write_text("up\n" if up else "down\n")
    (d / "uevent").write_text(uevent)
    if wireless:
        (d / "wireless").mkdir()
    return d


def test_the_best_network_that_is_up_is_reported(tmp_path):
    net = tmp_path / "net"
    virtual = tmp_path / "devices" / "virtual" / "net" / "docker0"
    virtual.mkdir(parents=True)
    (virtual / "operstate").write_text("up\n")
    net.mkdir()
    (net / "docker0").symlink_to(virtual)  # a bridge: not a way out
    assert _network(str(net)) is None  # nothing physical: say nothing
    _iface(net, "wwan0", uevent="DEVTYPE=wwan\n")
    assert _network(str(net)) == "cellular"
    _iface(net, "eth0", up=False)
    assert _network(str(net)) == "cellular"
    _iface(net, "wlan0", wireless=True)
    assert _network(str(net)) == "wifi"
    offline = tmp_path / "offline"
    _iface(offline, "eth1", up=False)
    assert _network(str(offline)) == "none"
    assert _network(str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    ("supplies", "expected"),
    [
        ({}, "yes"),  # no battery at all: on mains
        ({"BAT0": ("Battery", "Discharging")}, "no"),
        ({"BAT0": ("Battery", "Charging")}, "yes"),
        ({"BAT0": ("Battery", "Full")}, "yes"),
        ({"BAT0": ("Battery", "Discharging"), "AC": ("Mains", "1")}, "yes"),
        ({"BAT0": ("Battery", "Discharging"), "AC": ("Mains", "0")}, "no"),
        ({"BAT0": ("Battery", "Unknown")}, None),
    ],
)
def test_charging_is_read_from_the_power_supplies(tmp_path, supplies, expected):
    root = tmp_path / "power_supply"
    root.mkdir()
    for name, (kind, value) in supplies.items():
        d = root / name
        d.mkdir()
        (d / "type").write_text(kind + "\n")
        (d / ("status" if kind == "Battery" else "online")).write_text(value + "\n")
    assert _charging(str(root)) == expected


def test_an_operators_attr_wins_over_what_is_detected():
    found = {"ram_mb": 4096, "custom": {"network": "cellular", "charging": "no", "mnn": "3.6"}}
    merged = with_detected({"custom": {"network": "wifi"}}, found)
    assert merged["custom"] == {"network": "wifi", "charging": "no", "mnn": "3.6"}
