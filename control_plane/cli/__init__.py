"""The `skiff` command line: one module per command group, rendering, progress."""

from control_plane.cli.main import main

__all__ = ["main"]
