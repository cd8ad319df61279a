"""Run a script in a fresh interpreter, at the repository root: what it imports is its own.

A test process has long since imported everything; only a new interpreter can tell
what an import really pulls in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def printed_json(script: str, env: dict[str, str] | None = None):
    """Run `script` (with `env` added to the environment); return the JSON it printed on
    its last line (it must exit 0)."""
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])
