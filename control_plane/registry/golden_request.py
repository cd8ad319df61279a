"""What a push asks of its golden data: the request alone, with no numpy.

The operator's commands parse a push's flags into it, so it stays out of `golden`, whose
numpy a command that only talks to the server should not load (`skiff token create` and
the like start in ~0.1 s less).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from contract import errors
from control_plane.registry.contract import DEFAULT_MIN_COSINE, MAX_GOLDEN_UPLOAD

MAX_HINTS = 256  # --input-shape / --input-range entries per push


@dataclass(frozen=True)
class GoldenRequest:
    """What a push says about golden inputs and the accuracy bar."""

    golden: bytes = b""  # the publisher's .npz; b"" = build seeded inputs
    input_shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    input_ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    min_cosine: float = DEFAULT_MIN_COSINE
    allow_degraded: bool = False

    def check(self) -> None:
        """Validate everything that does not need the model; InvalidArgument names it."""
        if not 0.0 < self.min_cosine <= 1.0 or math.isnan(self.min_cosine):
            raise errors.InvalidArgument(f"min cosine {self.min_cosine} must be in (0, 1]")
        if len(self.golden) > MAX_GOLDEN_UPLOAD:
            raise errors.InvalidArgument(
                f"golden inputs take {len(self.golden) >> 20} MiB "
                f"(limit {MAX_GOLDEN_UPLOAD >> 20} MiB)"
            )
        if len(self.input_shapes) + len(self.input_ranges) > MAX_HINTS:
            raise errors.InvalidArgument(f"more than {MAX_HINTS} input shapes and ranges")
        for name, shape in self.input_shapes.items():
            if not shape or any(d < 1 for d in shape):
                raise errors.InvalidArgument(
                    f"input shape for {name!r:.64} must be positive dimensions, got {list(shape)}"
                )
        for name, (low, high) in self.input_ranges.items():
            if not (math.isfinite(high - low) and low <= high):
                raise errors.InvalidArgument(
                    f"input range for {name!r:.64} must be finite with low <= high, "
                    f"got {low}:{high}"
                )

    @property
    def source(self) -> str:
        """Say where the golden inputs come from: "publisher" or "seeded"."""
        return "publisher" if self.golden else "seeded"
