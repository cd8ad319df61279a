"""Every device-side module imports on its own, first, in a fresh interpreter.

An import cycle only shows when a module of the cycle is the first one imported: the
agent's entry point imports device_agent modules before control_plane ones, so a cycle
that the test suite's import order hides would stop the daemon from starting.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts)
    for package in ("device_agent", "control_plane/crypto", "control_plane/cli")
    for p in (ROOT / package).glob("*.py")
    if p.name != "__main__.py"
)


@pytest.mark.parametrize("module", MODULES)
def test_the_module_imports_first(module):
    done = subprocess.run(
        [sys.executable, "-c", f"import {module.removesuffix('.__init__')}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.strip().splitlines()[-1]


def test_the_command_line_loads_no_server_parts():
    """Every `skiff` call starts Python afresh: it must not pay for the server's imports.

    numpy and the MNN tooling came in through constants once (0.75 s -> 0.25 s a call);
    the database layer and the dashboard never belong in a client.
    """
    heavy = ("numpy", "sqlalchemy", "alembic", "MNN", "flask", "boto3", "rich")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, control_plane.cli.main; "
            "print(' '.join(sorted({n.split('.')[0] for n in sys.modules})))",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=True,
    )
    loaded = set(done.stdout.split())
    assert not loaded & set(heavy), sorted(loaded & set(heavy))
