"""Whether the tests run on CI, where a missing service or tool must fail, not skip."""

from __future__ import annotations

import os
from collections.abc import Mapping

# What CI systems set CI to. Anything else ("false", "0", "", unset) is a developer's
# machine: `CI=false make test` must not turn skips into failures, nor the reverse.
TRUE_VALUES = frozenset({"1", "true", "yes"})


def on_ci(environ: Mapping[str, str] | None = None) -> bool:
    """Return whether CI is set to a true value (1, true or yes, any case)."""
    environ = os.environ if environ is None else environ
    return environ.get("CI", "").strip().lower() in TRUE_VALUES
