"""`python -m control_plane.cli` runs the `skiff` command."""

import sys

from control_plane.cli.main import main

sys.exit(main())
