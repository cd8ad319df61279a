"""The command line's start-up cost: what `import control_plane.cli.main` loads."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


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
