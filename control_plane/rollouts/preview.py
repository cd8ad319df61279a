"""What a rollout would select before it exists: devices per stage and per slice.

`rollout create --dry-run` asks for it through `CreateRollout` (`dry_run`), so the
dashboard can show the same. Stage membership is the sticky hash of the rollout's id
(`lifecycle.bucket`): the preview draws the id the rollout would get and counts exactly
what that draw selects; the rollout created afterwards draws its own id, so its middle
stages hold about as many devices (the last stage, every selected device, is exact).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from control_plane.fleet.selector import Selector
from control_plane.rollouts.lifecycle import bucket, stage_limit
from control_plane.telemetry.classes import Dimension

# A slice attribute such as device_model can take many values: the preview lists the
# largest slices and counts the rest.
MAX_SLICES = 100


@dataclass(frozen=True)
class SlicePreview:
    """One slice: its name ("soc=sm8450") and how many devices each stage would hold."""

    slice: str
    devices: tuple[int, ...]


@dataclass(frozen=True)
class Preview:
    """How many live devices a rollout would select, in all and by stage (cumulative)."""

    selected: int
    stages: tuple[float, ...]
    devices: tuple[int, ...]
    slices: tuple[SlicePreview, ...] = ()
    more_slices: int = 0  # slices beyond MAX_SLICES, left out


def preview(
    rollout_id: str,
    selector: Selector,
    stages: tuple[float, ...],
    devices: Iterable[tuple[str, Mapping]],
    dimension: Dimension | None = None,
) -> Preview:
    """Count the devices `selector` picks, per stage and (with `dimension`) per slice."""
    limits = [stage_limit(stages, i) for i in range(len(stages))]
    per_stage: Counter[int] = Counter()
    per_slice: dict[str, Counter[int]] = {}
    selected = 0
    for device_id, attrs in devices:
        if not selector.matches(attrs):
            continue
        selected += 1
        first = _first_stage(bucket(rollout_id, device_id), limits)
        per_stage[first] += 1
        if dimension is not None:
            name = f"{dimension.name}={dimension.value(attrs)}"
            per_slice.setdefault(name, Counter())[first] += 1
    slices = sorted(
        (SlicePreview(name, _cumulative(c, len(stages))) for name, c in per_slice.items()),
        key=lambda s: (-s.devices[-1], s.slice),
    )
    return Preview(
        selected,
        stages,
        _cumulative(per_stage, len(stages)),
        tuple(slices[:MAX_SLICES]),
        max(0, len(slices) - MAX_SLICES),
    )


def _first_stage(device_bucket: int, limits: list[int]) -> int:
    """Return the index of the first stage that includes a device in this bucket."""
    return next(i for i, limit in enumerate(limits) if device_bucket < limit)


def _cumulative(first: Counter[int], n_stages: int) -> tuple[int, ...]:
    out, total = [], 0
    for i in range(n_stages):
        total += first[i]
        out.append(total)
    return tuple(out)
