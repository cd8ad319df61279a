"""What this device can hold, reported with every Sync for device fit.

The control plane assigns a version only to devices that fit it (memory, disk, the MNN
version it was built with: control_plane.rollouts.fit). The agent detects:

- `ram_mb`: the machine's memory (MemTotal);
- `custom.disk_free_mb`: what Skiff may use in the state directory's file system: its
  free space plus what Skiff's own artifacts there take (an installed version must not
  stop fitting because it is installed), rounded down to 16 MB so the figure does not
  move with every log line;
- `custom.mnn`: the MNN engine's major.minor;
- `custom.network` ("wifi", "ethernet", "cellular", "none") and `custom.charging`
  ("yes", "no"), for rollouts that download only on Wi-Fi or while charging
  (control_plane.rollouts.download_policy); left out when they cannot be told.

What the operator gives with `--attr` wins over what is detected, so a staging box can
pose as a smaller phone.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shutil
from pathlib import Path

__all__ = ["detected", "with_detected"]

_MiB = 1 << 20
_DISK_STEP_MB = 16


def detected(state_dir: Path, *owned: Path) -> dict:
    """Return the attributes this machine shows (a figure that cannot be read is left out).

    `owned`: the directories of Skiff's own downloads (artifacts, chunks), counted as
    free space.
    """
    out: dict = {}
    custom: dict[str, str] = {}
    ram = _mem_total_mb()
    if ram:
        out["ram_mb"] = ram
    try:
        free = shutil.disk_usage(state_dir).free + sum(_bytes_in(d) for d in owned)
        custom["disk_free_mb"] = str(free // _MiB // _DISK_STEP_MB * _DISK_STEP_MB)
    except OSError:
        pass
    if mnn := _mnn_version():
        custom["mnn"] = mnn
    if network := _network():
        custom["network"] = network
    if charging := _charging():
        custom["charging"] = charging
    if custom:
        out["custom"] = custom
    return out


def with_detected(operator: dict, found: dict) -> dict:
    """Return `found` under the operator's attributes (theirs win, custom keys merged)."""
    merged = {**found, **{k: v for k, v in operator.items() if k != "custom"}}
    custom = {**found.get("custom", {}), **operator.get("custom", {})}
    if custom:
        merged["custom"] = custom
    return merged


@functools.cache
def _mnn_version() -> str:
    """Return the installed MNN's major.minor ("" if unknown): read once, it cannot change."""
    try:
        major, minor, *_ = importlib.metadata.version("MNN").split(".")
        return f"{int(major)}.{int(minor)}"
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return ""


def _mem_total_mb() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        return None
    return None


def _bytes_in(directory: Path) -> int:
    total = 0
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    total += entry.stat(follow_symlinks=False).st_size
    except OSError:
        return 0
    return total


def _network(root: str = "/sys/class/net") -> str | None:
    """Return how the machine is online: "wifi", "ethernet", "cellular" or "none".

    From /sys/class/net: an interface that is up and not virtual (loopback, bridges,
    container veths live under /sys/devices/virtual); Wi-Fi first, then wired, then
    cellular (WWAN). None when no physical interface is found at all (a container, say):
    the control plane then holds nothing back for the network.
    """
    found = set()
    seen_physical = False
    try:
        entries = list(os.scandir(root))
    except OSError:
        return None
    for entry in entries:
        try:
            real = os.path.realpath(entry.path)
            if "/devices/virtual/" in real:
                continue
            seen_physical = True
            with open(os.path.join(entry.path, "operstate"), encoding="ascii") as f:
                if f.read().strip() != "up":
                    continue
            uevent = Path(entry.path, "uevent").read_text(encoding="ascii", errors="replace")
        except OSError:
            continue
        if Path(entry.path, "wireless").exists() or Path(entry.path, "phy80211").exists():
            found.add("wifi")
        elif "DEVTYPE=wwan" in uevent or entry.name.startswith(("wwan", "rmnet", "ccmni")):
            found.add("cellular")
        else:
            found.add("ethernet")
    if not seen_physical:
        return None
    return next((kind for kind in ("wifi", "ethernet", "cellular") if kind in found), "none")


def _charging(root: str = "/sys/class/power_supply") -> str | None:
    """Return "yes" when on external power, "no" on battery, None when it cannot tell.

    From /sys/class/power_supply: a mains or USB supply online, or a battery charging or
    full, is "yes"; a battery discharging with no supply online is "no". A machine with no
    battery at all runs on mains: "yes".
    """
    try:
        supplies = list(os.scandir(root))
    except FileNotFoundError:
        return "yes"  # no power-supply class: no battery to run on
    except OSError:
        return None
    online, battery = False, None
    for entry in supplies:
        try:
            kind = Path(entry.path, "type").read_text(encoding="ascii").strip()
            if kind == "Battery":
                battery = Path(entry.path, "status").read_text(encoding="ascii").strip()
            elif Path(entry.path, "online").read_text(encoding="ascii").strip() == "1":
                online = True
        except OSError:
            continue
    if online or battery in ("Charging", "Full", "Not charging"):
        return "yes"
    return "no" if battery == "Discharging" else ("yes" if battery is None else None)
