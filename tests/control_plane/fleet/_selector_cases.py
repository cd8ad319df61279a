"""Devices and a shorthand shared by the selector tests (test_selector_*.py)."""

from __future__ import annotations

from control_plane.fleet.attributes import normalize_attributes
from control_plane.fleet.selector import parse_selector

PIXEL = normalize_attributes(
    {
        "platform": "android",
        "os_version": "14",
        "app_version": "5.10.0",
        "device_model": "Pixel 8 Pro",
        "soc": "tensor_g3",
        "ram_mb": 12288,
        "region": "eu",
        "tags": ["beta", "dogfood"],
        "custom": {"batch": "8", "tier": "gold", "ratio": "0.5", "build": "x86"},
    }
)
BARE = {}  # a device that reports nothing


def matches(text: str, attrs: dict) -> bool:
    return parse_selector(text).matches(attrs)
