"""The rollout state machine, stage parsing and sticky membership (pure functions)."""

from __future__ import annotations

import pytest

from contract import errors
from control_plane.rollouts.lifecycle import (
    BUCKETS,
    TRANSITIONS,
    Action,
    RolloutState,
    bucket,
    next_step,
    parse_duration,
    parse_stage_list,
    parse_stages,
    stage_index,
    stage_limit,
    stage_number,
    stage_text,
)

S, A = RolloutState, Action


@pytest.mark.parametrize(
    ("state", "action", "stage", "expected"),
    [
        (S.ACTIVE, A.PROMOTE, 0, (S.ACTIVE, 1)),
        (S.ACTIVE, A.PROMOTE, 2, (S.COMPLETED, 2)),
        (S.ACTIVE, A.ADVANCE, 1, (S.ACTIVE, 2)),
        (S.ACTIVE, A.PAUSE, 1, (S.PAUSED, 1)),
        (S.PAUSED, A.RESUME, 1, (S.ACTIVE, 1)),
        (S.ACTIVE, A.ROLLBACK, 1, (S.ROLLED_BACK, 1)),
        (S.COMPLETED, A.ROLLBACK, 2, (S.ROLLED_BACK, 2)),
    ],
)
def test_allowed_transitions(state, action, stage, expected):
    assert next_step(state, action, stage, 3) == expected


@pytest.mark.parametrize(
    ("state", "action"),
    [
        (S.ACTIVE, A.RESUME),
        (S.PAUSED, A.PAUSE),
        (S.PAUSED, A.ADVANCE),  # a paused rollout does not bake forward
        (S.PAUSED, A.PROMOTE),  # nor is it promoted: paused is frozen
        (S.COMPLETED, A.PROMOTE),
        (S.COMPLETED, A.PAUSE),
        (S.ROLLED_BACK, A.RESUME),
        (S.ROLLED_BACK, A.ROLLBACK),
    ],
)
def test_illegal_transitions_name_the_current_state(state, action):
    with pytest.raises(errors.FailedPrecondition, match=f"that is {state.value}"):
        next_step(state, action, 0, 3)


def test_a_paused_rollout_is_frozen_until_resumed():
    # Promote used to move a paused rollout on (still "paused") and deliver the next stage.
    for action in (A.PROMOTE, A.ADVANCE):
        with pytest.raises(errors.FailedPrecondition, match="resume it first") as caught:
            next_step(S.PAUSED, action, 1, 3)
        assert "stage 2 of 3" in str(caught.value)  # numbered from 1, as people read it


def test_stage_numbers_are_one_based_for_people():
    assert stage_number(0) == 1
    assert stage_index(3, 3) == 2
    assert stage_text(1, (10.0, 50.0, 100.0)) == "stage 2 of 3 (50%)"
    for bad in (0, 4):
        with pytest.raises(errors.InvalidArgument, match="numbered 1 to 3"):
            stage_index(bad, 3)


def test_every_state_but_rolled_back_can_reach_rolled_back():
    reachable = {s for (s, a), t in TRANSITIONS.items() if t == S.ROLLED_BACK}
    assert reachable == {S.ACTIVE, S.PAUSED, S.COMPLETED}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ([10, 5, 100], "must increase"),
        ([1, 10, 50], "last stage must be 100"),
        ([0, 100], "must be in"),
        ([50, 150], "must be in"),
        ([float("nan"), 100], "must be in"),
        ([10, 10, 100], "must increase"),
        (list(range(1, 100, 4)) + [100], "at most"),
    ],
)
def test_bad_stages_are_refused(values, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        parse_stages(values)


def test_stage_parsing():
    assert parse_stages([]) == (100.0,)
    assert parse_stage_list("1, 10,50,100") == (1.0, 10.0, 50.0, 100.0)
    assert parse_stage_list("0.5,100") == (0.5, 100.0)
    with pytest.raises(errors.InvalidArgument, match="invalid stages"):
        parse_stage_list("1,ten,100")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90), ("30s", 30), ("10m", 600), ("2h", 7200), ("7d", 604800), ("1h30m", 5400)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten", "10x", "-5m", "5m!"])
def test_bad_durations(text):
    with pytest.raises(errors.InvalidArgument):
        parse_duration(text)


def test_membership_is_sticky_and_nested():
    devices = [f"dev_{i:016x}" for i in range(5000)]
    stages = (1.0, 10.0, 50.0, 100.0)
    members = [
        {d for d in devices if bucket("ro_a", d) < stage_limit(stages, i)}
        for i in range(len(stages))
    ]
    assert members[0] <= members[1] <= members[2] <= members[3] == set(devices)
    # Roughly the right share at each stage (binomial noise on 5000 devices).
    assert 10 <= len(members[0]) <= 100
    assert 350 <= len(members[1]) <= 650
    assert 2300 <= len(members[2]) <= 2700
    # Same device, same bucket, every time; another rollout draws another sample.
    assert all(bucket("ro_a", d) == bucket("ro_a", d) for d in devices[:50])
    other = {d for d in devices if bucket("ro_b", d) < stage_limit(stages, 1)}
    assert other != members[1]


def test_buckets_cover_the_range():
    seen = {bucket("ro_x", f"dev_{i}") for i in range(50_000)}
    assert min(seen) < 10 and max(seen) > BUCKETS - 10
