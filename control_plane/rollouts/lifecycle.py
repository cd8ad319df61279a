"""Rollout states, the one table of allowed transitions, stages and sticky membership."""

from __future__ import annotations

import enum
import hashlib
import math
import re
from collections.abc import Sequence

from control_plane import errors

BUCKETS = 10_000  # membership resolution: 0.01% of the selected devices
MAX_STAGES = 20
MAX_BAKE_S = 90 * 86_400
MAX_PRIORITY = 1_000_000


class RolloutState(enum.StrEnum):
    """Where a rollout is in its life."""

    ACTIVE = "active"
    PAUSED = "paused"
    COMPLETED = "completed"
    ROLLED_BACK = "rolled_back"


class Action(enum.StrEnum):
    """What an operator (or the scheduler) does to a rollout."""

    PAUSE = "pause"
    RESUME = "resume"
    PROMOTE = "promote"
    ADVANCE = "advance"  # the scheduler, when a stage's bake time has passed
    ROLLBACK = "rollback"


S, A = RolloutState, Action
# The one table: (state, action) -> next state. A promote or advance from the last stage
# completes the rollout (see `next_step`).
TRANSITIONS: dict[tuple[RolloutState, Action], RolloutState] = {
    (S.ACTIVE, A.PAUSE): S.PAUSED,
    (S.ACTIVE, A.PROMOTE): S.ACTIVE,
    (S.ACTIVE, A.ADVANCE): S.ACTIVE,
    (S.ACTIVE, A.ROLLBACK): S.ROLLED_BACK,
    (S.PAUSED, A.RESUME): S.ACTIVE,
    (S.PAUSED, A.PROMOTE): S.PAUSED,
    (S.PAUSED, A.ROLLBACK): S.ROLLED_BACK,
    (S.COMPLETED, A.ROLLBACK): S.ROLLED_BACK,
}
# States whose rollouts can still decide a device's desired version.
LIVE_STATES = (S.ACTIVE, S.PAUSED, S.COMPLETED)


def next_step(
    state: RolloutState, action: Action, stage: int, n_stages: int
) -> tuple[RolloutState, int]:
    """Return the (state, stage) `action` leads to, or FailedPrecondition naming the state."""
    target = TRANSITIONS.get((state, action))
    if target is None:
        allowed = sorted(a.value for (s, a) in TRANSITIONS if s == state and a != A.ADVANCE)
        raise errors.FailedPrecondition(
            f"cannot {action.value} a rollout that is {state.value}"
            + (f" (allowed: {', '.join(allowed)})" if allowed else " (it is final)")
        )
    if action in (A.PROMOTE, A.ADVANCE):
        if stage + 1 >= n_stages:
            return S.COMPLETED, stage
        return target, stage + 1
    return target, stage


def parse_stages(values: Sequence[float]) -> tuple[float, ...]:
    """Validate stage percentages: increasing, each in (0, 100], the last exactly 100."""
    stages = tuple(float(v) for v in values) or (100.0,)
    if len(stages) > MAX_STAGES:
        raise errors.InvalidArgument(f"at most {MAX_STAGES} stages, got {len(stages)}")
    for i, pct in enumerate(stages):
        if not math.isfinite(pct) or not 0 < pct <= 100:
            raise errors.InvalidArgument(f"stage {i + 1} is {pct:g}%: each must be in (0, 100]")
        if i and pct <= stages[i - 1]:
            raise errors.InvalidArgument(
                f"stages must increase: stage {i + 1} ({pct:g}%) <= stage {i} ({stages[i - 1]:g}%)"
            )
    if stages[-1] != 100:
        raise errors.InvalidArgument(f"the last stage must be 100%, got {stages[-1]:g}%")
    return stages


def parse_stage_list(text: str) -> tuple[float, ...]:
    """Parse the CLI's `1,10,50,100` into validated stages."""
    try:
        return parse_stages([float(p) for p in text.split(",") if p.strip()])
    except ValueError:
        raise errors.InvalidArgument(f"invalid stages {text!r}: use e.g. 1,10,50,100") from None


_DURATION = re.compile(r"(\d+)([smhdw]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400, "w": 604_800}


def parse_duration(text: str) -> int:
    """Parse `90`, `30s`, `10m`, `2h`, `7d`, `1w` (or sums like `1h30m`) into seconds."""
    text = text.strip()
    pos, total = 0, 0
    while pos < len(text):
        m = _DURATION.match(text, pos)
        if m is None:
            raise errors.InvalidArgument(f"invalid duration {text!r}: use e.g. 30s, 10m, 2h, 7d")
        total += int(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not text:
        raise errors.InvalidArgument("empty duration")
    return total


def bucket(rollout_id: str, device_id: str) -> int:
    """Return the device's sticky bucket in [0, BUCKETS) for this rollout.

    A keyed hash of both ids: the same device lands in the same bucket every time (so a
    device in the 10% stage stays in at 50%, and a late enrollee lands where it would have
    from the start), and different rollouts draw independent samples of the fleet.
    """
    digest = hashlib.blake2b(device_id.encode(), digest_size=8, key=rollout_id.encode()).digest()
    return int.from_bytes(digest, "big") % BUCKETS


def stage_limit(stages: Sequence[float], stage: int) -> int:
    """Return how many buckets the current stage covers (devices with bucket < limit)."""
    return round(stages[stage] * BUCKETS / 100)
