"""The `skiff` command line: one module per command group, rendering, progress."""

import os
import sys

# gRPC's C core reads GRPC_VERBOSITY once, when grpc is imported (below, through main), and
# would otherwise log a failed TLS handshake to stderr on its own. A client command reports
# that in one line and its exit code, so keep the core's lines out of its output; the
# long-running commands keep them. The command is always the first argument.
if sys.argv[1:2] not in (["server"], ["demo"]):
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")

from control_plane.cli.main import main  # noqa: E402

__all__ = ["main"]
