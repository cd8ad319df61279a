"""Rollouts through the admin API, and how their changes reach watching devices."""

from __future__ import annotations

import time

import pytest

from contract import errors
from protos import fleet_pb2
from tests.control_plane.api.device_helpers import Device, Watching
from tests.control_plane.helpers import Address

ANDROID = {"platform": "android", "app_version": "5.3", "soc": "sm8650"}
IOS = {"platform": "ios", "app_version": "5.3"}


def create(client, version=1, **kw):
    return client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=version, **kw))


def desired(cp, device_id):
    with cp.client() as client:
        d = client.get_device(device_id).desired.get("det")
    return None if d is None else (d.version, d.variant, d.rollout)


def test_create_show_and_audit(published):
    cp = published
    with cp.client() as client:
        r = create(
            client,
            2,
            variant="int8",
            selector="platform = android",
            stages=[10, 100],
            bake_s=600,
            priority=3,
            reason="canary",
            allow_empty=True,  # no device enrolled yet: meant, not a typo
        )
        # Stages are numbered from 1 in every message.
        assert r.id.startswith("ro_") and r.state == "active" and r.stage == 1
        assert r.selector == "platform=android"  # stored in canonical form
        assert list(r.stages) == [10.0, 100.0] and r.bake_s == 600 and r.priority == 3
        client.transition_rollout(r.id, "pause", "looking at crashes")
        client.transition_rollout(r.id, "resume")
        shown = client.get_rollout(r.id)
        assert [(e.action, e.from_state, e.to_state) for e in shown.audit] == [
            ("create", "", "active"),
            ("pause", "active", "paused"),
            ("resume", "paused", "active"),
        ]
        assert shown.audit[0].reason == "canary" and shown.audit[1].actor == "admin"
        assert [x.id for x in client.list_rollouts("det")] == [r.id]
        assert client.list_rollouts("other") == []


@pytest.mark.parametrize(
    ("kw", "error", "message"),
    [
        ({"model": "nope", "version": 1}, errors.NotFound, "nope"),
        ({"model": "det", "version": 9}, errors.NotFound, "det:9"),
        ({"model": "det", "version": 1, "variant": "int4"}, errors.NotFound, "no variant"),
        (
            {"model": "det", "version": 1, "selector": "platform=="},
            errors.InvalidArgument,
            "position 9",
        ),
        (
            {"model": "det", "version": 1, "stages": [50, 10, 100]},
            errors.InvalidArgument,
            "increase",
        ),
        ({"model": "det", "version": 1, "stages": [10, 50]}, errors.InvalidArgument, "100"),
        ({"model": "det", "version": 1, "bake_s": -1}, errors.InvalidArgument, "bake"),
        ({"model": "det", "version": 1, "reason": "x" * 600}, errors.InvalidArgument, "reason"),
    ],
)
def test_bad_rollouts_are_refused(published, kw, error, message):
    with published.client() as client:
        with pytest.raises(error, match=message):
            client.create_rollout(fleet_pb2.CreateRolloutRequest(**kw))
        assert client.list_rollouts() == []


def test_illegal_transitions_name_the_state(published):
    with published.client() as client:
        r = create(client, 1)
        client.transition_rollout(r.id, "promote")  # one stage: completes
        with pytest.raises(errors.FailedPrecondition, match="completed"):
            client.transition_rollout(r.id, "resume")
        with pytest.raises(errors.InvalidArgument, match="unknown action"):
            client.transition_rollout(r.id, "explode")
        with pytest.raises(errors.NotFound):
            client.transition_rollout("ro_0000000000", "pause")
        client.transition_rollout(r.id, "rollback")
        with pytest.raises(errors.FailedPrecondition, match="final"):
            client.transition_rollout(r.id, "rollback")


def test_stages_counts_and_rollback(published, enroll_token):
    cp = published
    devices = [Device.enroll(cp.address, enroll_token, ANDROID) for _ in range(12)]
    ios = Device.enroll(cp.address, enroll_token, IOS)
    with cp.client() as client:
        base = create(client, 1)
        client.transition_rollout(base.id, "promote")  # det:1 completed everywhere
        r = create(client, 2, selector="platform=android", stages=[25, 50, 100])
        shown = client.get_rollout(r.id)
        assert shown.counts.selected == 12
        first = {d.id for d in devices if desired(cp, d.id)[0] == 2}
        assert shown.counts.in_stage == len(first)
        client.transition_rollout(r.id, "promote")
        second = {d.id for d in devices if desired(cp, d.id)[0] == 2}
        assert first <= second  # sticky: nobody leaves the rollout as it widens
        for d in devices:
            d.install(d.sync(), "det")
            d.sync()  # reports what it installed
        time.sleep(0.3)  # device reports are written behind
        shown = client.get_rollout(r.id)
        assert shown.counts.synced == len(second) == shown.counts.installed
        assert desired(cp, ios.id)[:2] == (1, "fp32")
        client.transition_rollout(r.id, "rollback", "p95 regression")
        assert {desired(cp, d.id)[:2] for d in devices} == {(1, "fp32")}
        assert client.get_rollout(r.id).state == "rolled_back"


def test_bake_time_advances_stages(published, enroll_token):
    with published.client() as client:
        r = create(client, 1, stages=[10, 100], bake_s=1)
        deadline = time.monotonic() + 10
        while client.get_rollout(r.id).state != "completed" and time.monotonic() < deadline:
            time.sleep(0.2)
        shown = client.get_rollout(r.id)
    assert shown.state == "completed"
    assert [e.actor for e in shown.audit if e.action == "advance"] == ["scheduler", "scheduler"]


def test_watch_tells_only_affected_devices(published, enroll_token):
    cp = published
    android = Device.enroll(cp.address, enroll_token, ANDROID)
    ios = Device.enroll(cp.address, enroll_token, IOS)
    android.sync(), ios.sync()
    with Watching(android) as a, Watching(ios) as i:
        time.sleep(0.3)
        with cp.client() as client:
            create(client, 1, selector="platform=android")
            assert client.get_device(android.id).online
        assert a.wait(1, timeout=5)
        assert not i.wait(1, timeout=1.0)  # its desired state did not change
    assert a.events[0] > android.revision
    assert android.sync().models["det"].version == 1


def test_watch_catches_up_after_a_missed_change(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    device.sync()
    with cp.client() as client:
        create(client, 1)
    # It was not watching when the rollout was created: the stream tells it at once.
    assert device.next_watch_event(timeout=5) is not None
    device.sync()
    assert device.next_watch_event(timeout=0.5) is None


def test_revoke_closes_the_open_stream(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    device.sync()
    with Watching(device) as w:
        time.sleep(0.3)
        with cp.client() as client:
            client.revoke_device(device.id)
        w.wait(1, timeout=5)
        deadline = time.monotonic() + 5
        while w.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
    assert w.error is not None and "revoked" in str(w.error)
    with cp.client() as client:
        assert not client.get_device(device.id).online


def test_fleet_ls_selects_with_the_rollout_evaluator(published, enroll_token):
    cp = published
    a = Device.enroll(cp.address, enroll_token, {**ANDROID, "tags": ["beta"]})
    untagged = Device.enroll(cp.address, enroll_token, IOS)
    with cp.client() as client:
        assert [d.id for d in client.list_devices("platform=android,tags=beta")] == [a.id]
        # A device without tags has an empty tag set: "everyone but beta" includes it.
        assert [d.id for d in client.list_devices("tags!=beta")] == [untagged.id]
        assert [d.id for d in client.list_devices("tags not in (beta, x)")] == [untagged.id]
        assert len(client.list_devices("")) == 2
        with pytest.raises(errors.InvalidArgument, match="position"):
            client.list_devices("platform in (a,")
        with pytest.raises(errors.InvalidArgument):
            client.get_device("nope")
        with pytest.raises(errors.NotFound):
            client.get_device("dev_0000000000000000")


def test_state_survives_a_restart_mid_rollout(published, enroll_token):
    from control_plane.app import build_app
    from control_plane.serve import create_server

    cp = published
    device = Device.enroll(cp.address, enroll_token, ANDROID)
    with cp.client() as client:
        r = create(client, 2, stages=[50, 100])
        client.transition_rollout(r.id, "promote", "halfway")
    before = device.sync()
    cp.stop()
    app = build_app(cp.config)
    server, port = create_server(cp.config, app, "127.0.0.1:0")
    server.start()
    try:
        device.address = Address(f"127.0.0.1:{port}", cp.tls)
        after = device.sync()  # same identity, same credential, same answer
        assert after.models["det"].version == before.models["det"].version == 2
        assert after.revision >= before.revision
        # Nothing changed while it was away: its stream stays quiet.
        assert device.next_watch_event(timeout=0.5) is None
        from control_plane.api.client import AdminClient

        with AdminClient(device.address, cp.token, cp.tls) as client:
            shown = client.get_rollout(r.id)
            assert (shown.state, shown.stage) == ("active", 2)
            assert [e.action for e in shown.audit] == ["create", "promote"]
            client.transition_rollout(r.id, "rollback")
        assert device.next_watch_event(timeout=5) is not None
    finally:
        server.stop()
        cp.server, cp.app = server, app  # the fixture stops and closes these
