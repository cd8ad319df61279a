"""What `skiff agent status` shows, read from the state directory alone (no secret)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from contract.server_clock import describe_offset
from device_agent.clock_reading import load_reading
from device_agent.install import Installer
from device_agent.state import AgentError, StateDir


def _holder(state: StateDir) -> int | None:
    """Return the pid of the agent holding the state directory, None if none runs."""
    path = state.path / "agent.lock"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else 0
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _slot_view(slot: dict | None) -> dict | None:
    if not slot:
        return None
    keep = ("version", "variant", "rollout", "config", "degraded", "activated_at", "probes")
    return {k: slot.get(k) for k in keep}


def read_status(path: Path) -> dict:
    """Return the agent's status as `skiff agent status --json` prints it."""
    state = StateDir(path)
    if not state.path.is_dir():
        raise AgentError(f"{state.path} is not an agent state directory")
    identity = state.load_identity()
    sync = state.load_sync()
    pid = _holder(state)
    installer = Installer(state, unwrap=lambda wrapped, uid: b"")  # reads pointers only
    models = {}
    for name, p in installer.pointers().items():
        failed = p.get("failed")
        models[name] = {
            "active": _slot_view(p.get("active")),
            "previous": _slot_view(p.get("previous")),
            "failed": None
            if not failed
            else {k: failed.get(k) for k in ("version", "variant", "reason", "at")},
        }
    clock = load_reading(state.path)
    return {
        "device_id": identity.device_id if identity else "",
        "server": identity.server if identity else "",
        "attributes": identity.attributes if identity else {},
        "running": pid is not None,
        "pid": pid,
        "revision": sync.revision,
        "last_sync": sync.last_sync,
        "last_error": sync.last_error,
        "last_error_at": sync.last_error_at,
        # The device's wall clock minus the control plane's time at the last accepted
        # answer (positive: ahead); None before the first. Reports use the latter's time.
        "clock_offset_s": round(clock.offset_s, 3) if clock else None,
        "clock_measured_at": clock.to_json()["measured_at"] if clock else None,
        "clock": describe_offset(clock.offset_s) if clock else None,
        "models": models,
    }
