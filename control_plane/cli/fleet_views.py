"""What the CLI prints about devices, rollouts and API tokens: JSON documents and text.

Both are control_plane.views' (shared with the dashboard and the demo); the CLI's commands
take them from here, under the one name they have always used.
"""

from __future__ import annotations

from control_plane.views.fleet import (  # noqa: F401 - re-exported for the CLI's commands
    api_token_dict,
    attributes_dict,
    backends_dict,
    device_dict,
    device_fit,
    fit_dict,
    install_dict,
    iso_or_none,
    latency_dict,
    preview_dict,
    rollout_dict,
)
from control_plane.views.fleet_text import (  # noqa: F401 - re-exported for the CLI's commands
    CLOCK_NOTE_S,
    api_tokens_table,
    backends_text,
    degraded_how,
    device_text,
    devices_table,
    paused_text,
    preview_text,
    rollout_text,
    rollouts_table,
    stage_text,
    transition_text,
)
