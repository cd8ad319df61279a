"""Nothing surprises an operator: a paused rollout stays paused, a typo never ships to no
device, a degraded variant never ships by accident, and stages are numbered one way.

Through the admin API (and the dashboard's pages and handlers on the same control plane).
"""

from __future__ import annotations

import datetime as dt
import html
import json

import pytest

from contract import errors
from control_plane.rollouts.lifecycle import bucket, stage_limit
from control_plane.rollouts.service import Rollouts
from dashboards.web.app import create_app
from protos import fleet_pb2
from tests.control_plane.api.device_helpers import Device

ANDROID = {"platform": "android", "app_version": "5.3", "soc": "sm8650"}
IOS = {"platform": "ios", "app_version": "5.3", "soc": "a17"}


def create(client, version=1, **kw) -> fleet_pb2.Rollout:
    return client.create_rollout(fleet_pb2.CreateRolloutRequest(model="det", version=version, **kw))


def desired_version(client, device_id: str) -> int | None:
    d = client.get_device(device_id).desired.get("det")
    return None if d is None else d.version


def in_first_stage(rollout: fleet_pb2.Rollout, device_id: str) -> bool:
    return bucket(rollout.id, device_id) < stage_limit(list(rollout.stages), 0)


def later(cp, seconds: float) -> Rollouts:
    """The scheduler's rollout domain with its clock `seconds` ahead (no waiting)."""
    ahead = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=seconds)
    return Rollouts(cp.app.store, cp.app.resolver, clock=lambda: ahead)


def test_a_paused_rollout_is_frozen_until_resumed(published, enroll_token):
    """`rollout promote` of a paused rollout printed "paused, stage 2/2 (100%)" and every
    selected device installed the version: now refused, and nothing beyond the stage moves."""
    cp = published
    devices = [Device.enroll(cp.address, enroll_token, ANDROID) for _ in range(16)]
    with cp.client() as client:
        r = create(client, 2, selector="platform=android", stages=[50, 100], bake_s=600)
        assert r.stage == 1  # numbered from 1
        inside = {d.id for d in devices if in_first_stage(r, d.id)}
        assert 0 < len(inside) < len(devices)  # some devices are beyond the first stage
        client.transition_rollout(r.id, "pause", "looking at crashes")
        with pytest.raises(errors.FailedPrecondition) as refused:
            client.transition_rollout(r.id, "promote", expected_stage=1)
        said = str(refused.value)
        assert "paused" in said and "resume it first" in said and "stage 1 of 2" in said
        # Bake time passing does not move it on either (the scheduler, an hour later).
        assert later(cp, 3600).advance_due() == []
        shown = client.get_rollout(r.id)
        assert (shown.state, shown.stage) == ("paused", 1)
        assert [e.action for e in shown.audit] == ["create", "pause"]
        # The stage's devices keep the version; no device beyond it gets it.
        got = {d.id for d in devices if desired_version(client, d.id) == 2}
        assert got == inside
        assert shown.counts.in_stage == len(inside)

        # Resuming restarts the stage's bake: not due 30 s later, due after the bake.
        client.transition_rollout(r.id, "resume")
        assert later(cp, 30).advance_due() == []
        (advanced,) = later(cp, 3600).advance_due()
        assert (advanced.state, advanced.stage) == ("active", 1)  # the record's index
        shown = client.get_rollout(r.id)
        assert shown.stage == 2
        assert [e.stage for e in shown.audit] == [1, 1, 1, 2]  # create, pause, resume, advance
        assert {d.id for d in devices if desired_version(client, d.id) == 2} == {
            d.id for d in devices
        }


def test_a_pause_and_resume_while_the_scheduler_decides_restarts_the_bake(published):
    """The scheduler read the rollout, its bake had passed; an operator paused and resumed
    it before the scheduler wrote: the resume restarted the bake, so nothing advances."""
    with published.client() as client:
        r = create(client, 2, stages=[50, 100], bake_s=600, halt=["crash_rate>0.5"])

        def operator_meanwhile(record) -> bool:
            client.transition_rollout(r.id, "pause", "a look")
            client.transition_rollout(r.id, "resume", "looked")
            return True  # the guard's rules passed

        assert later(published, 3600).advance_due(ready=operator_meanwhile) == []
        shown = client.get_rollout(r.id)
        assert (shown.state, shown.stage) == ("active", 1)
        assert [e.action for e in shown.audit] == ["create", "pause", "resume"]
        # Once the restarted bake has passed, it does advance.
        (advanced,) = later(published, 2 * 3600).advance_due(ready=lambda _: True)
        assert advanced.stage == 1  # the record's index: stage 2


def test_a_slice_of_a_paused_rollout_is_not_readmitted(published):
    with published.client() as client:
        r = create(client, 2, stages=[50, 100], slice_by="soc", halt=["crash_rate>0.5"])
        client.transition_rollout(r.id, "rollback", "slow", slice="soc=sm8450")
        client.transition_rollout(r.id, "pause", "a look")
        with pytest.raises(errors.FailedPrecondition, match="resume the rollout first"):
            client.transition_rollout(r.id, "resume", "fixed", slice="soc=sm8450")
        # Rolling another slice back while paused only takes the version away: allowed.
        client.transition_rollout(r.id, "rollback", "slow too", slice="soc=sm8650")
        client.transition_rollout(r.id, "resume", "looked")
        client.transition_rollout(r.id, "resume", "fixed", slice="soc=sm8450")


def test_expected_stage_is_numbered_from_1(published):
    with published.client() as client:
        r = create(client, 1, stages=[10, 100])
        with pytest.raises(errors.InvalidArgument, match="numbered 1 to 2"):
            client.transition_rollout(r.id, "promote", expected_stage=0)
        with pytest.raises(errors.FailedPrecondition, match="stage 1 of 2 .10%., not stage 2"):
            client.transition_rollout(r.id, "promote", expected_stage=2)
        assert client.transition_rollout(r.id, "promote", expected_stage=1).stage == 2


def test_a_typo_in_a_selector_is_refused_naming_the_key(published, enroll_token):
    """`rollout create --select 'platfrom=android'` exited 0: active, selected 0."""
    cp = published
    Device.enroll(cp.address, enroll_token, {**ANDROID, "custom": {"tier": "gold"}})
    with cp.client() as client:
        with pytest.raises(errors.InvalidArgument, match="did you mean `platform`"):
            create(client, selector="platfrom=android")
        with pytest.raises(errors.InvalidArgument, match="did you mean `platform`"):
            client.list_devices("platfrom=android")  # `fleet ls --select`: the same refusal
        with pytest.raises(errors.InvalidArgument, match="write `custom.tier`"):
            create(client, selector="tier=gold")
        assert client.list_rollouts() == []
        # Custom attributes are custom.KEY, here as in `fleet ls --select`.
        assert len(client.list_devices("custom.tier=gold")) == 1
        made = create(client, selector="custom.tier = gold")
        assert made.selector == "custom.tier=gold"


def test_a_selector_matching_no_device_needs_allow_empty(published, enroll_token):
    cp = published
    Device.enroll(cp.address, enroll_token, ANDROID)
    with cp.client() as client:
        with pytest.raises(errors.FailedPrecondition) as refused:
            create(client, selector="platform=ios")
        assert "matches none of the 1 devices" in str(refused.value)
        assert "--allow-empty" in str(refused.value)
        assert client.list_rollouts() == []
        made = create(client, selector="platform=ios", allow_empty=True)
        assert made.state == "active" and made.counts.selected == 0
        # The whole fleet is never refused, even an empty one.
        assert create(client, 2).state == "active"


def test_a_dry_run_counts_per_stage_and_slice_and_creates_nothing(published, enroll_token):
    cp = published
    for attrs in [ANDROID] * 6 + [{**ANDROID, "soc": "sm8450"}] * 4 + [IOS] * 3:
        Device.enroll(cp.address, enroll_token, attrs)
    with cp.client() as client:
        before = cp.app.store.list_rollouts()
        shown = create(
            client,
            selector="platform=android",
            stages=[50, 100],
            halt=["crash_rate>0.01"],
            slice_by="soc",
            dry_run=True,
        )
        assert shown.id == "" and shown.state == "active"
        p = shown.preview
        assert p.selected == 10 and len(p.devices) == 2 and p.devices[-1] == 10
        assert 0 <= p.devices[0] <= 10
        slices = {s.slice: list(s.devices) for s in p.slices}
        assert set(slices) == {"soc=sm8650", "soc=sm8450"}
        assert slices["soc=sm8650"][-1] == 6 and slices["soc=sm8450"][-1] == 4
        assert sum(v[0] for v in slices.values()) == p.devices[0]
        # A typo still fails a dry run; an empty one is shown, not refused.
        with pytest.raises(errors.InvalidArgument, match="did you mean"):
            create(client, selector="platfrom=android", dry_run=True)
        assert create(client, selector="platform=linux", dry_run=True).preview.selected == 0
        assert client.list_rollouts() == [] and cp.app.store.list_rollouts() == before


def test_a_degraded_variant_needs_allow_degraded_and_is_marked(published, onnx_path):
    """`rollout create --variant int8` of a variant scored cosine 0.0000 went to 8 devices."""
    cp = published
    with cp.client() as client:
        pushed = client.push(
            onnx_path,
            name="det",
            variants=("int8",),
            min_cosine=0.9999999,  # a bar int8 cannot reach
            allow_degraded=True,
            allow_duplicate=True,  # det:2's bytes, held to another bar
        )
        (int8,) = [v for v in pushed.variants if v.name == "int8"]
        assert int8.degraded
        with pytest.raises(errors.FailedPrecondition) as refused:
            create(client, pushed.version, variant="int8")
        said = str(refused.value)
        assert "degraded" in said and "--allow-degraded" in said
        assert "relative error" in said or "cosine" in said  # the bar it missed
        assert client.list_rollouts() == []
        made = create(client, pushed.version, variant="int8", allow_degraded=True)
        shown = client.get_rollout(made.id)
        assert shown.degraded and shown.degraded_reason in said and shown.degraded_allowed
        evidence = json.loads(shown.audit[0].evidence_json)
        assert evidence["allow_degraded"] is True and evidence["variant"] == "int8"
        # The same version's fp32 is not degraded: no flag needed, none shown.
        plain = client.get_rollout(create(client, pushed.version).id)
        assert not plain.degraded and plain.degraded_reason == ""
    page = _logged_in(cp).get(f"/rollouts/{made.id}").get_data(as_text=True)
    assert 'id="degraded"' in page and "rolled out with --allow-degraded" in page
    assert html.escape(shown.degraded_reason) in page


def _logged_in(cp):
    web = create_app(cp.app, secure_cookies=False)
    browser = web.test_client()
    r = browser.post("/login", data={"token": cp.token, "next": "/"})
    assert r.status_code == 302
    return browser


def _csrf(page: str) -> str:
    marker = 'name="csrf" value="'
    start = page.index(marker) + len(marker)
    return page[start : page.index('"', start)]


def test_the_dashboard_says_what_the_cli_says(published, enroll_token):
    cp = published
    for _ in range(4):
        Device.enroll(cp.address, enroll_token, ANDROID)
    browser = _logged_in(cp)
    with cp.client() as client:
        r = create(client, 1, stages=[25, 50, 100])
        client.transition_rollout(r.id, "promote", expected_stage=1)
        client.transition_rollout(r.id, "pause", "hold")
        shown = client.get_rollout(r.id)
    page = browser.get(f"/rollouts/{r.id}").get_data(as_text=True)
    # One numbering: the API's stage 2 is the page's stage 2, the audit's too.
    assert shown.stage == 2
    assert 'Stage <span id="stage">2</span> of 3 (50%)' in page
    assert [e.stage for e in shown.audit] == [1, 2, 2]
    for stage in (1, 2, 2):
        assert f'<td class="stage">{stage}</td>' in page
    assert page.count('<td class="stage">') == 3
    doc = browser.get(f"/api/v1/rollouts/{r.id}", headers={"Authorization": f"Bearer {cp.token}"})
    assert doc.json["stage"] == 2 and [e["stage"] for e in doc.json["audit"]] == [1, 2, 2]
    # Paused is frozen, in the words the CLI prints.
    assert "until it is resumed: neither its bake time nor a promote moves it on" in page
    assert 'id="action-promote"' not in page and 'id="action-resume"' in page
    confirm = browser.get(f"/rollouts/{r.id}/confirm?action=pause")
    assert confirm.status_code == 409  # already paused: nothing to confirm
    refused = browser.get(f"/rollouts/{r.id}/confirm?action=promote")
    assert refused.status_code == 409 and "resume it first" in refused.get_data(as_text=True)
    # A forged promote form is refused too, and nothing moves.
    resume_page = browser.get(f"/rollouts/{r.id}/confirm?action=resume").get_data(as_text=True)
    assert "stage 2 of 3 (50%)" in resume_page and "bake time starts over" in resume_page
    form = {
        "csrf": _csrf(resume_page),
        "action": "promote",
        "seen_state": "paused",
        "seen_stage": "2",
        "slice": "",
    }
    assert browser.post(f"/rollouts/{r.id}/actions", data=form).status_code == 409
    with cp.client() as client:
        assert client.get_rollout(r.id).stage == 2
    # The resume the page offers goes through, from the stage it showed.
    form["action"] = "resume"
    assert browser.post(f"/rollouts/{r.id}/actions", data=form).status_code == 302
    with cp.client() as client:
        assert (client.get_rollout(r.id).state, client.get_rollout(r.id).stage) == ("active", 2)


def test_a_degraded_rollout_from_before_the_flag_does_not_claim_it():
    from control_plane.cli.fleet_views import rollout_text

    old = fleet_pb2.Rollout(
        id="ro_0123456789",
        model="m",
        version=1,
        variant="int8",
        state="active",
        stages=[100],
        stage=1,
        degraded=True,
        degraded_reason="cosine 0.0000 below 0.99",
    )
    text = rollout_text(old)
    assert "created before --allow-degraded was required" in text
    assert "rolled out with" not in text


def test_custom_attributes_are_shown_as_a_selector_writes_them():
    from control_plane.fleet.selector import parse_selector
    from control_plane.views.fleet_text import _attributes_text

    shown = _attributes_text({"platform": "ios", "custom": {"tier": "gold"}})
    assert shown == "platform=ios, custom.tier=gold"
    for clause in shown.split(", "):  # what is shown can be pasted into --select
        parse_selector(clause, strict=True)
