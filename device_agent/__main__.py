"""`python -m device_agent` runs the `skiff` command, as the console script does."""

import sys

from device_agent.cli import main

sys.exit(main())
