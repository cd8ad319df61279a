"""When a device may fetch a rollout's version: on which network, and whether charging.

A rollout may say `--download-on wifi` (an unmetered network: Wi-Fi or a wired one)
and `--download-while charging`; both default to `any`. The agent reports
`custom.network` ("wifi", "ethernet", "cellular" or "none") and `custom.charging` ("yes"
or "no") with every Sync (device_agent.device_facts; an operator's `--attr` wins, and a
simulated device says what its profile gives it). A device whose conditions do not allow
the download yet is not assigned the version: it keeps what it would have had without
the rollout (as a device that does not fit), and `rollout show` counts it as waiting, by
reason, until a Sync reports conditions that allow it; nothing counts it as failed.

A device that does not report a condition (an older agent, or one that could not tell)
is not held back for it.
"""

from __future__ import annotations

from collections.abc import Mapping

from contract import errors

__all__ = ["CHARGING", "DOWNLOAD_ON", "DOWNLOAD_WHILE", "WIFI", "check", "waits"]

DOWNLOAD_ON = ("any", "wifi")
DOWNLOAD_WHILE = ("any", "charging")
# Reasons, as `rollout show` counts them.
WIFI, CHARGING = "wifi", "charging"
_UNMETERED = ("wifi", "ethernet")


def check(download_on: str, download_while: str) -> tuple[str, str]:
    """Return the policy with defaults filled in; InvalidArgument naming a bad value."""
    on, during = download_on or "any", download_while or "any"
    if on not in DOWNLOAD_ON:
        raise errors.InvalidArgument(
            f"--download-on must be one of {', '.join(DOWNLOAD_ON)}, got {on!r:.40}"
        )
    if during not in DOWNLOAD_WHILE:
        raise errors.InvalidArgument(
            f"--download-while must be one of {', '.join(DOWNLOAD_WHILE)}, got {during!r:.40}"
        )
    return on, during


def waits(download_on: str, download_while: str, attrs: Mapping) -> tuple[str, str] | None:
    """Return (reason, detail) when a device must wait to download; None when it may."""
    custom = attrs.get("custom") or {}
    network = custom.get("network")
    if download_on == "wifi" and isinstance(network, str) and network not in _UNMETERED:
        return WIFI, f"waits for Wi-Fi (on {network:.20})"
    charging = custom.get("charging")
    if download_while == "charging" and charging == "no":
        return CHARGING, "waits for a charger"
    return None
