"""A server whose stop hangs still obeys SIGTERM: stacks to its log, exit 1, in bounded time.

CI once saw `skiff server` ignore SIGTERM for 30 s after a cancelled upload, and the log
said nothing about why. The server now arms a watchdog when told to stop.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

from control_plane.home import init_home
from control_plane.settings import load_config

# Runs the real `skiff server`, with a stop that never returns and a short limit.
HANGING_STOP = textwrap.dedent(
    """
    import sys, threading
    import control_plane.serve as serve
    serve.STOP_GRACE_S, serve.STOP_LIMIT_S = 0, 1
    def stuck_stop(self, grace=None):
        threading.Event().wait()
    serve.ServerHandle.stop = stuck_stop
    from control_plane.cli.main import main
    sys.exit(main())
    """
)


def test_a_stop_that_hangs_dumps_every_stack_and_exits_1(tmp_path):
    home = tmp_path / "home"
    init_home(load_config(home, environ={}))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            HANGING_STOP,
            "server",
            "--home",
            str(home),
            "--grpc",
            "127.0.0.1:0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert "listening on" in proc.stdout.readline()
        proc.terminate()
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, stderr
    # Where it hung, for the report: the main thread's stack, in the stop.
    assert "Timeout (0:00:01)!" in stderr, stderr
    assert "in stuck_stop" in stderr, stderr
