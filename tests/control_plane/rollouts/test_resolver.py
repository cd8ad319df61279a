"""Desired-state resolution: precedence, stages, pause, completion, rollback."""

from __future__ import annotations

import datetime as dt

from control_plane.rollouts.lifecycle import bucket, stage_limit
from control_plane.rollouts.resolver import Resolver, Snapshot
from control_plane.store.rollouts import RolloutRecord

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
ANDROID = {"platform": "android", "app_version": "5.3", "soc": "sm8650", "tags": ["beta"]}
IOS = {"platform": "ios", "app_version": "5.3"}


def rollout(
    rid,
    version,
    *,
    selector="",
    stages=(100.0,),
    stage=0,
    state="active",
    priority=0,
    minutes=0,
    model="det",
    variant="fp32",
) -> RolloutRecord:
    t = T0 + dt.timedelta(minutes=minutes)
    return RolloutRecord(
        rid, model, version, variant, selector, stages, stage, state, 0, priority, t, "admin", t
    )


def snapshot(*records) -> Snapshot:
    resolver = Resolver(store=None)
    return Snapshot(7, [resolver.live(r) for r in records])


def desired_version(snap, device="dev_1", attrs=ANDROID, model="det"):
    d = snap.desired_model(model, device, attrs)
    return None if d is None else (d.version, d.rollout)


def test_nothing_desired_without_rollouts():
    assert snapshot().desired("dev_1", ANDROID) == {}


def test_selector_decides_who_gets_it():
    snap = snapshot(rollout("ro_a", 2, selector="platform=android"))
    assert desired_version(snap) == (2, "ro_a")
    assert desired_version(snap, attrs=IOS) is None


def test_highest_priority_then_newest_wins():
    snap = snapshot(
        rollout("ro_old", 2, minutes=0),
        rollout("ro_new", 3, minutes=5),
        rollout("ro_prio", 4, minutes=1, priority=10),
    )
    assert desired_version(snap) == (4, "ro_prio")
    snap = snapshot(rollout("ro_old", 2, minutes=0), rollout("ro_new", 3, minutes=5))
    assert desired_version(snap) == (3, "ro_new")


def test_completed_rollout_is_the_fallback_and_newest_completed_wins():
    snap = snapshot(
        rollout("ro_c1", 1, state="completed", minutes=0),
        rollout("ro_c2", 2, state="completed", minutes=1, selector="soc=sm8650"),
    )
    assert desired_version(snap) == (2, "ro_c2")
    assert desired_version(snap, attrs=IOS) == (1, "ro_c1")


def test_a_device_outside_the_current_stage_keeps_the_completed_version():
    devices = [f"dev_{i:04d}" for i in range(400)]
    staged = rollout("ro_s", 3, stages=(10.0, 100.0), stage=0, minutes=5)
    snap = snapshot(rollout("ro_c", 2, state="completed"), staged)
    got = {d: desired_version(snap, device=d)[0] for d in devices}
    inside = {d for d in devices if bucket("ro_s", d) < stage_limit(staged.stages, 0)}
    assert {d for d, v in got.items() if v == 3} == inside
    assert all(v == 2 for d, v in got.items() if d not in inside)
    assert 15 <= len(inside) <= 70


def test_paused_rollout_holds_its_devices_and_rolled_back_releases_them():
    paused = snapshot(rollout("ro_c", 1, state="completed"), rollout("ro_p", 2, state="paused"))
    assert desired_version(paused) == (2, "ro_p")
    back = snapshot(rollout("ro_c", 1, state="completed"), rollout("ro_p", 2, state="rolled_back"))
    assert desired_version(back) == (1, "ro_c")


def test_models_are_independent():
    snap = snapshot(rollout("ro_a", 2), rollout("ro_b", 5, model="kws", selector="tags=beta"))
    assert {m: d.version for m, d in snap.desired("dev_1", ANDROID).items()} == {
        "det": 2,
        "kws": 5,
    }
    assert set(snap.desired("dev_1", IOS)) == {"det"}
