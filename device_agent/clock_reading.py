"""The agent's last measurement of the control plane's clock, kept in its state directory.

A restarted agent reads the wall clock shifted by this offset until its first Sync answer
measures a fresh one (contract.server_clock).
"""

from __future__ import annotations

from pathlib import Path

from contract.server_clock import Reading
from device_agent.state import AgentError, read_json, write_json

CLOCK_FILE = "clock.json"


def load_reading(state_dir: Path) -> Reading | None:
    """Return the last reading an agent stored in `state_dir` (None if none or unreadable)."""
    try:
        body = read_json(Path(state_dir) / CLOCK_FILE)
    except AgentError:
        return None
    return None if body is None else Reading.from_json(body)


def save_reading(state_dir: Path, reading: Reading) -> None:
    """Store a reading in `state_dir` (atomically, 0600)."""
    write_json(Path(state_dir) / CLOCK_FILE, reading.to_json())
