"""`skiff rollout wait` and `skiff rollout show --watch`: follow one rollout by polling it.

The control plane has no watch call for rollouts, so both read the rollout with one
GetRollout every `--interval` seconds (POLL_S by default: a viewer's read, cheap for the
server however many scripts wait). They take the clock and the sleep as arguments, so
tests drive them without waiting on real time. Stages are numbered from 1, as the
message has them.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TextIO

from contract import errors
from control_plane.rollouts.lifecycle import TRANSITIONS, Action, RolloutState

if TYPE_CHECKING:
    from protos import fleet_pb2

POLL_S = 2.0
# A rollout in one of these has nothing more to do by itself (a completed one can still be
# rolled back by an operator, but never moves on its own).
FINISHED = frozenset({RolloutState.COMPLETED.value, RolloutState.ROLLED_BACK.value})

_MOVES = (Action.PROMOTE, Action.ADVANCE)
Clock = Callable[[], float]
Sleep = Callable[[float], None]


class WaitTimedOut(errors.SkiffError):
    """`rollout wait --timeout` passed before the rollout got where it was waited for."""


def stage_text(r: fleet_pb2.Rollout) -> str:
    """Return where a rollout is: "stage 2 of 3 (50%)" (`r.stage` counts from 1)."""
    from control_plane.cli.fleet_views import stage_text as text  # protobuf: on first use

    return text(r.stage, r.stages)


def status_line(r: fleet_pb2.Rollout) -> str:
    """Return a rollout's state, stage and device counts on one line."""
    c = r.counts
    return (
        f"{r.id}: {r.state}, {stage_text(r)}; devices selected {c.selected}, in stage "
        f"{c.in_stage}, synced {c.synced}, installed {c.installed}, failed {c.failed}"
    )


@dataclass(frozen=True)
class Goal:
    """What `rollout wait` waits for: a stage (1-based) or a state."""

    stage: int | None = None
    state: str = RolloutState.COMPLETED.value

    def __str__(self) -> str:
        return f"stage {self.stage}" if self.stage is not None else f"state {self.state}"

    def check(self, r: fleet_pb2.Rollout) -> bool:
        """Return whether `r` is there; FailedPrecondition if it never can be."""
        if self.stage is not None:
            if not 1 <= self.stage <= len(r.stages):
                raise errors.InvalidArgument(
                    f"rollout {r.id} has {len(r.stages)} stages: --stage 1 to {len(r.stages)}"
                )
            if r.state == RolloutState.ROLLED_BACK:
                raise errors.FailedPrecondition(
                    f"rollout {r.id} was rolled back at {stage_text(r)}: it will never "
                    f"reach stage {self.stage}"
                )
            return r.state == RolloutState.COMPLETED or r.stage >= self.stage
        if r.state == self.state:
            return True
        if self.state not in _reachable(RolloutState(r.state)):
            raise errors.FailedPrecondition(
                f"rollout {r.id} is {r.state} at {stage_text(r)}: it can never be {self.state}"
            )
        return False


def _reachable(state: RolloutState) -> set[str]:
    """Return the states a rollout in `state` can still get to (the lifecycle's table)."""
    seen, todo = set(), [state]
    while todo:
        current = todo.pop()
        for (source, action), target in TRANSITIONS.items():
            if source != current:
                continue
            # A promote or advance from the last stage completes (lifecycle.next_step).
            ends = (target, RolloutState.COMPLETED) if action in _MOVES else (target,)
            for reached in ends:
                if reached.value not in seen:
                    seen.add(reached.value)
                    todo.append(reached)
    return seen


def wait(
    get: Callable[[], fleet_pb2.Rollout],
    goal: Goal,
    *,
    timeout_s: float = 0.0,
    on_change: Callable[[fleet_pb2.Rollout], None] | None = None,
    clock: Clock = time.monotonic,
    sleep: Sleep = time.sleep,
    poll_s: float = POLL_S,
) -> fleet_pb2.Rollout:
    """Poll `get` until the rollout reaches `goal`; return it as it was then.

    `on_change` sees the first reading still short of the goal, and each later one whose
    state or stage moved. WaitTimedOut once `timeout_s` (0: none) has passed;
    FailedPrecondition as soon as the rollout can no longer get there (rolled back, say).
    """
    deadline = clock() + timeout_s if timeout_s else None
    seen = None
    while True:
        r = get()
        if goal.check(r):
            return r
        if on_change is not None and (r.state, r.stage) != seen:
            seen = (r.state, r.stage)
            on_change(r)
        pause = poll_s
        if deadline is not None:
            left = deadline - clock()
            if left <= 0:
                raise WaitTimedOut(
                    f"rollout {r.id} did not reach {goal} within {timeout_s:g}s: "
                    f"it is {r.state} at {stage_text(r)}"
                )
            pause = min(poll_s, left)
        sleep(pause)


def watch(
    get: Callable[[], fleet_pb2.Rollout],
    *,
    out: TextIO,
    as_json: bool = False,
    sleep: Sleep = time.sleep,
    now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    poll_s: float = POLL_S,
) -> fleet_pb2.Rollout:
    """Follow a rollout until it is finished (completed or rolled back); return it then.

    On a terminal (and without `as_json`) the whole `rollout show` text is redrawn in
    place; anywhere else one line is printed per change (with `as_json`, the rollout's
    JSON document, one per line), so a log or a pipe reads as a history.
    """
    from control_plane.cli import fleet_views

    if out.isatty() and not as_json:
        return _redraw(get, out=out, sleep=sleep, poll_s=poll_s)
    last = None
    while True:
        r = get()
        if as_json:
            line = json.dumps(fleet_views.rollout_dict(r), sort_keys=True)
            changed = line != last
        else:
            line = status_line(r)
            changed = line != last
        if changed:
            last = line
            stamp = "" if as_json else now().strftime("%Y-%m-%dT%H:%M:%SZ ")
            print(stamp + line, file=out, flush=True)
        if r.state in FINISHED:
            return r
        sleep(poll_s)


def _redraw(
    get: Callable[[], fleet_pb2.Rollout], *, out: TextIO, sleep: Sleep, poll_s: float
) -> fleet_pb2.Rollout:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    from control_plane.cli import fleet_views

    console = Console(file=out, highlight=False)
    footer = f"(refreshed every {poll_s:g}s; Ctrl-C to stop watching)"
    with Live(console=console, auto_refresh=False, transient=False) as live:
        while True:
            r = get()
            finished = r.state in FINISHED
            text = fit(fleet_views.rollout_text(r), console.size.height - 1)
            live.update(Text(text if finished else f"{text}\n{footer}"), refresh=True)
            if finished:
                return r
            sleep(poll_s)


def fit(text: str, height: int) -> str:
    """Cut `rollout show` text to `height` lines, dropping the oldest audit entries first."""
    lines = text.splitlines()
    if len(lines) <= height or height < 3:
        return text
    audit = next((i for i, line in enumerate(lines) if line.strip() == "audit"), None)
    if audit is None or audit + 2 >= height:
        return "\n".join(lines[: height - 1] + ["  ..."])
    keep = height - audit - 2  # the newest entries that fit under a "... N earlier" line
    dropped = len(lines) - audit - 1 - keep
    return "\n".join(
        lines[: audit + 1] + [f"    ... {dropped} earlier entries"] + lines[len(lines) - keep :]
    )


def poll_seconds(text: str) -> float:
    """Parse `--interval`: seconds between two reads, from 0.1 to an hour."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.1 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds from 0.1 to 3600")
    return value
