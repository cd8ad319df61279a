"""What the CLI prints about models and versions: JSON documents and text.

Both are control_plane.views' (shared with the dashboard and the demo); the CLI's commands
take them from here, under the one name they have always used.
"""

from __future__ import annotations

from control_plane.views.registry import (  # noqa: F401 - re-exported for the CLI's commands
    model_dict,
    version_dict,
)
from control_plane.views.registry_text import (  # noqa: F401 - re-exported for the CLI's commands
    models_table,
    version_text,
)
