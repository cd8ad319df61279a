"""Device fit: whether a device can run a version's variant, before it is assigned it.

A variant's manifest entry says what it needs (`requirements`: memory_mb, disk_mb, and
the MNN major.minor that built it); a device's attributes say what it has: `ram_mb`, and
under `custom` the `disk_free_mb` Skiff may use and its `mnn` version (the agent detects
all three; an operator's `--attr` wins, so a staging box can pose as a smaller phone).
A device that does not fit is not assigned the variant: it keeps what it would have had
without that rollout, and `rollout show` counts it as ineligible, by reason.

Only what is known rules a device out: a device that does not report a figure (an older
agent) is not refused for it, and a variant that needs nothing fits everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["MEMORY", "DISK", "ENGINE", "misfit"]

# Reasons, as counted by `rollout show`.
MEMORY, DISK, ENGINE = "memory", "disk", "engine"


def misfit(needs: Mapping, attrs: Mapping) -> tuple[str, str] | None:
    """Return (reason, detail) when the device cannot run the variant; None when it fits."""
    custom = attrs.get("custom") or {}
    memory = _number(needs.get("memory_mb"))
    ram = _number(attrs.get("ram_mb"))
    if memory and ram and ram < memory:
        return MEMORY, f"needs {memory:,} MB of memory, the device has {ram:,}"
    disk = _number(needs.get("disk_mb"))
    free = _number(custom.get("disk_free_mb"))
    if disk and free is not None and free < disk:
        return DISK, f"needs {disk:,} MB of disk, the device has {free:,} free"
    engine = _version(needs.get("mnn"))
    have = _version(custom.get("mnn"))
    if engine and have and have < engine:
        wanted, got = ".".join(map(str, engine)), ".".join(map(str, have))
        return ENGINE, f"built with MNN {wanted}, the device runs MNN {got}"
    return None


def _number(value: object) -> int | None:
    """Return a whole number from an int or a decimal string; None for anything else."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isascii() and value.isdecimal() and len(value) < 16:
        return int(value)
    return None


def _version(value: object) -> tuple[int, int] | None:
    """Return (major, minor) of "3.6" or "3.6.1"; None for anything else."""
    if not isinstance(value, str):
        return None
    parts = value.split(".")
    if len(parts) < 2 or not all(p.isascii() and p.isdecimal() and len(p) < 6 for p in parts[:2]):
        return None
    return int(parts[0]), int(parts[1])
