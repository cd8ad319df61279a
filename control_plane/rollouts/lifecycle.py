"""Rollout states, the one table of allowed transitions, stages and sticky membership.

**Paused is frozen.** A paused rollout stays at its stage: neither its bake time nor a
promote moves it on (a promote is refused, naming the state: resume first). What its
current stage already includes is unchanged: those devices keep the version, and one of
them that has not installed it yet still gets it; no device beyond the stage gets it.
Resuming restarts the stage's bake time.

**Stages are numbered from 1** wherever people or scripts see them: "stage 2 of 3 (50%)"
in every text, `stage` in the API's messages and every `--json`. Only the store and the
code here keep the 0-based index into `stages` (`stage_number` converts).
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from collections.abc import Sequence

from contract import errors

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
    # No promote nor advance: a paused rollout is frozen at its stage (see above).
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
    if target is None and state == S.PAUSED and action in (A.PROMOTE, A.ADVANCE):
        raise errors.FailedPrecondition(
            f"cannot {action.value} a rollout that is paused: it stays at stage "
            f"{stage_number(stage)} of {n_stages} until it is resumed (resume it first, then "
            "promote)"
        )
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


def stage_number(index: int) -> int:
    """Return the 1-based number people and the API use for a stage's 0-based index."""
    return index + 1


def stage_index(number: int, n_stages: int) -> int:
    """Return the 0-based index of stage `number` (1-based); InvalidArgument out of range."""
    if not 1 <= number <= n_stages:
        raise errors.InvalidArgument(
            f"there is no stage {number}: stages are numbered 1 to {n_stages}"
        )
    return number - 1


def stage_text(index: int, stages: Sequence[float]) -> str:
    """Describe the stage at `index`: "stage 2 of 3 (50%)"."""
    return f"stage {stage_number(index)} of {len(stages)} ({stages[index]:g}%)"


def paused_text(index: int, stages: Sequence[float]) -> str:
    """Say what a paused rollout does, in the words every surface uses (see above)."""
    return (
        f"it stays at {stage_text(index, stages)} until it is resumed: neither its bake "
        "time nor a promote moves it on; the devices this stage includes keep the version "
        "(one that has not installed it yet still gets it), and no other device gets it"
    )


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
