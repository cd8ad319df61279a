"""What this device can hold, reported with every Sync for device fit.

The control plane assigns a version only to devices that fit it (memory, disk, the MNN
version it was built with: control_plane.rollouts.fit). The agent detects:

- `ram_mb`: the machine's memory (MemTotal);
- `custom.disk_free_mb`: what Skiff may use in the state directory's file system: its
  free space plus what Skiff's own artifacts there take (an installed version must not
  stop fitting because it is installed), rounded down to 16 MB so the figure does not
  move with every log line;
- `custom.mnn`: the MNN engine's major.minor.

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


def detected(state_dir: Path, artifacts: Path) -> dict:
    """Return the attributes this machine shows (a figure that cannot be read is left out)."""
    out: dict = {}
    custom: dict[str, str] = {}
    ram = _mem_total_mb()
    if ram:
        out["ram_mb"] = ram
    try:
        free = shutil.disk_usage(state_dir).free + _bytes_in(artifacts)
        custom["disk_free_mb"] = str(free // _MiB // _DISK_STEP_MB * _DISK_STEP_MB)
    except OSError:
        pass
    if mnn := _mnn_version():
        custom["mnn"] = mnn
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
