"""Attested attributes over real gRPC: a device cannot claim what an enrollment token stamps.

Shared fixtures and helpers: _attack_helpers.py.
"""

from __future__ import annotations

import grpc

from protos import device_pb2
from tests.control_plane.api._attack_helpers import (
    ANDROID,
    code_of,
    enroll,
    rollout,
    sync_with,
    token_for,
)
from tests.control_plane.api._attack_helpers import plane as plane  # fixture
from tests.control_plane.api._attack_helpers import run_id as run_id  # fixture


def _listed(cp, selector: str) -> list[str]:
    with cp.client() as client:
        return [d.id for d in client.list_devices(selector)]


def test_a_claimed_tag_gets_neither_the_version_nor_its_key(plane, run_id):
    """Any device can claim a tag and receive a restricted model's key.

    An enrollment token stamps `tags=internal` and a rollout selects `tags=internal`; a
    device enrolled with the public token reported `tags=internal` at Sync and was
    assigned the version and unwrapped its data key (tags were the union of stamped and
    reported ones, and no selector could tell them apart). Now `@tags=internal` matches
    only the token's stamp: the claimer is not selected, gets no assignment, no key and no
    bytes, while the device enrolled with the stamping token gets all three.
    """
    cp = plane
    internal = token_for(cp, run_id, attributes={"tags": ["internal"]})
    public = token_for(cp, run_id)
    insider = enroll(cp, run_id, ANDROID, token=internal)
    claimer = enroll(cp, run_id, {**ANDROID, "tags": ["internal"]}, token=public)
    rollout(cp, run_id, 1, "@tags=internal")

    assert claimer.sync().models == {}
    assert list(sync_with(claimer, claimer.attributes).models) == []
    verified = insider.sync()
    m = verified.models["det"]
    assert m.version == 1 and m.wrapped_data_key
    assert insider.install(verified, "det")  # unwraps its key, decrypts, checks the digest
    denied = grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: claimer.download(m.ciphertext_sha256, m.ciphertext_size)) == denied

    # The same evaluator in `fleet ls --select`; a plain clause still sees the claim.
    assert _listed(cp, f"custom.run={run_id}, @tags=internal") == [insider.id]
    plain = _listed(cp, f"custom.run={run_id}, tags=internal")
    assert sorted(plain) == sorted([insider.id, claimer.id])
    with cp.client() as client:
        shown = {d.id: d for d in client.list_devices(f"custom.run={run_id}")}
    assert list(shown[insider.id].attested.tags) == ["internal"]
    assert list(shown[claimer.id].attested.tags) == []
    assert shown[claimer.id].attested.custom["run"] == run_id  # what its token stamped


def test_a_device_reporting_an_attested_attribute_cannot_change_or_add_to_it(plane, run_id):
    cp = plane
    stamps = {"region": "eu", "tags": ["managed"], "custom": {"tier": "gold"}}
    device = enroll(cp, run_id, ANDROID, token=token_for(cp, run_id, attributes=stamps))
    claims = {
        **ANDROID,
        "region": "us",
        "tags": ["managed", "beta"],
        "custom": {"run": run_id, "tier": "platinum", "Tier": "platinum", "seat": "a1"},
    }
    device.attributes = claims
    for selector in (
        "@region=us",
        "@region in (us)",
        "@tags=beta",
        "tags=beta",  # stamped tags replace reported ones: no tag can be added
        "@custom.tier=platinum",
        "@custom.Tier=platinum",  # a key of its own is never attested
        "@custom.seat=a1",
    ):
        rollout(cp, run_id, 1, selector)
    assert device.sync().models == {}

    wanted = "@region=eu, @tags=managed, @custom.tier=gold, custom.Tier=platinum, custom.seat=a1"
    rollout(cp, run_id, 2, wanted)
    assert [m.version for m in device.sync().models.values()] == [2]
    with cp.client() as client:
        shown = client.get_device(device.id)
    assert (shown.attributes.region, list(shown.attributes.tags)) == ("eu", ["managed"])
    assert dict(shown.attributes.custom) == {
        "run": run_id,
        "tier": "gold",
        "Tier": "platinum",
        "seat": "a1",
    }
    assert shown.attested == device_pb2.DeviceAttributes(
        region="eu", tags=["managed"], custom={"run": run_id, "tier": "gold"}
    )
    # Saying nothing takes away what it said, and nothing attested.
    assert list(sync_with(device, {}).models) == []
    with cp.client() as client:
        after = client.get_device(device.id)
    assert after.attested == shown.attested
    assert (after.attributes.region, list(after.attributes.tags)) == ("eu", ["managed"])
    assert dict(after.attributes.custom) == {"run": run_id, "tier": "gold"}
