"""`skiff token`, `skiff fleet` and `skiff rollout` as scripts run them: real processes."""

from __future__ import annotations

import json

from tests.control_plane.api.device_helpers import Device
from tests.control_plane.cli.test_cli import _error_line, model_file, server, skiff  # noqa: F401


def _address(running) -> str:
    return running["env"]["SKIFF_SERVER"]


def test_fleet_and_rollouts_from_the_command_line(server, model_file):  # noqa: F811
    env = server["env"]
    skiff("model", "push", str(model_file), "--name", "kws", env=env)
    made = json.loads(
        skiff(
            "token",
            "create",
            "--enroll",
            "--ttl",
            "1h",
            "--uses",
            "5",
            "--attr",
            "region=eu",
            "--attr",
            "tags=lab",
            "--json",
            env=env,
        ).stdout
    )
    assert made["token"].startswith("ske_") and made["uses"] == 5
    assert made["attributes"] == {"region": "eu", "tags": ["lab"]}
    plain = skiff("token", "create", "--enroll", env=env).stdout.strip()
    assert plain.startswith("ske_") and "\n" not in plain

    android = Device.enroll(_address(server), made["token"], {"platform": "android"})
    ios = Device.enroll(_address(server), made["token"], {"platform": "ios"})
    listed = json.loads(skiff("fleet", "ls", "--json", env=env).stdout)["devices"]
    assert {d["id"] for d in listed} >= {android.id, ios.id}
    for key in ("id", "attributes", "last_seen", "online", "installed", "desired"):
        assert key in listed[0]
    picked = json.loads(
        skiff("fleet", "ls", "--select", "platform=android,region=eu", "--json", env=env).stdout
    )["devices"]
    assert [d["id"] for d in picked] == [android.id]
    assert picked[0]["attributes"] == {"platform": "android", "region": "eu", "tags": ["lab"]}
    assert picked[0]["attested"] == {"region": "eu", "tags": ["lab"]}
    claimer = Device.enroll(_address(server), plain, {"platform": "linux", "region": "eu"})
    attested = json.loads(
        skiff("fleet", "ls", "--select", "@region=eu, @tags=lab", "--json", env=env).stdout
    )["devices"]
    assert sorted(d["id"] for d in attested) == sorted([android.id, ios.id])
    shown = json.loads(skiff("fleet", "show", claimer.id, "--json", env=env).stdout)
    assert shown["attributes"]["region"] == "eu" and shown["attested"] == {}
    text = skiff("fleet", "show", android.id, env=env).stdout
    assert "  attributes  platform=android, region=eu, tags=lab\n" in text
    assert "  attested    region=eu, tags=lab  (stamped by its enrollment token)\n" in text
    assert "  attested    -\n" in skiff("fleet", "show", claimer.id, env=env).stdout

    rid = skiff(
        "rollout",
        "create",
        "kws:1",
        "--select",
        "platform=android",
        "--stages",
        "50,100",
        env=env,
    ).stdout.strip()
    assert rid.startswith("ro_")
    shown = json.loads(skiff("rollout", "show", rid, "--json", env=env).stdout)
    for key in (
        "id",
        "model",
        "version",
        "variant",
        "selector",
        "stages",
        "stage",
        "state",
        "audit",
        "counts",
    ):
        assert key in shown
    assert (shown["model"], shown["version"], shown["variant"]) == ("kws", 1, "fp32")
    assert shown["stages"] == [50.0, 100.0] and shown["stage"] == 1  # numbered from 1
    assert shown["counts"]["selected"] == 1
    promoted = skiff("rollout", "promote", rid, "--reason", "looks good", env=env).stdout
    assert f"{rid}: active at stage 2 of 2 (100%)" in promoted
    device = json.loads(skiff("fleet", "show", android.id, "--json", env=env).stdout)
    assert device["desired"] == {"kws": {"version": 1, "variant": "fp32", "rollout": rid}}
    other = json.loads(skiff("fleet", "show", ios.id, "--json", env=env).stdout)
    assert other["desired"] == {}

    illegal = skiff("rollout", "resume", rid, env=env, check=False)
    assert illegal.returncode == 7 and "active" in _error_line(illegal)
    listed = json.loads(skiff("rollout", "ls", "--model", "kws", "--json", env=env).stdout)
    assert [r["id"] for r in listed["rollouts"]] == [rid] and listed["more"] is False
    assert "kws:1" in skiff("rollout", "ls", env=env).stdout
    skiff("rollout", "rollback", rid, env=env)
    device = json.loads(skiff("fleet", "show", android.id, "--json", env=env).stdout)
    assert device["desired"] == {}

    revoked = json.loads(skiff("fleet", "revoke", ios.id, "--json", env=env).stdout)
    assert revoked["revoked"] is True


def test_fleet_cli_bad_input(server):  # noqa: F811
    env = server["env"]
    bad = skiff("fleet", "ls", "--select", "ram_mb>lots", env=env, check=False)
    assert bad.returncode == 3 and "position" in _error_line(bad)
    missing = skiff("rollout", "create", "nope:1", env=env, check=False)
    assert missing.returncode == 4 and "nope" in _error_line(missing)
    noversion = skiff("rollout", "create", "kws", env=env, check=False)
    assert noversion.returncode == 3 and "version" in _error_line(noversion)
    stages = skiff("rollout", "create", "kws:1", "--stages", "10,5", env=env, check=False)
    assert stages.returncode == 3
    for args, fragment in [
        (["--halt", "p95_latency_ratio>>1.2"], "'p95_latency_ratio>>1.2': at position 19"),
        (["--halt", "p42_latency>1"], "unknown metric 'p42_latency'"),
        (["--halt", "crash_rate>0.1", "--slice-by", "colour"], "unknown slice attribute 'colour'"),
        (["--slice-by", "soc"], "--slice-by needs at least one --halt rule"),
        (["--halt", "crash_rate>0.1", "--min-devices", "-1"], "min devices"),
        # No baseline by assignment when every selected device is in the first stage.
        (["--halt", "p95_latency_ratio>1.2"], "a first stage of 100% leaves none"),
        (["--halt", "decode_tps_ratio>0.9"], "decode_tps_ratio halts when it falls: use '<'"),
    ]:
        halt = skiff("rollout", "create", "kws:1", *args, env=env, check=False)
        line = _error_line(halt)
        assert halt.returncode == 3 and fragment in line, (args, line)
        assert halt.stdout == ""
    unknown = skiff("fleet", "show", "dev_00000000deadbeef", env=env, check=False)
    assert unknown.returncode == 4
    attr = skiff("token", "create", "--enroll", "--attr", "oops", env=env, check=False)
    assert attr.returncode == 3 and "oops" in _error_line(attr)
    no_kind = skiff("token", "create", env=env, check=False)
    assert no_kind.returncode == 2


def test_token_rules_are_refused_for_a_model_that_is_not_a_language_model(server, model_file):  # noqa: F811
    env = server["env"]
    skiff("model", "push", str(model_file), "--name", "spotter", env=env)
    halt = skiff(
        "rollout",
        "create",
        "spotter:1",
        "--halt",
        "decode_tps_ratio<0.9",
        "--stages",
        "10,100",
        env=env,
        check=False,
    )
    assert halt.returncode == 3 and halt.stdout == ""
    assert "decode_tps_ratio judges a language model's tokens, and spotter:1 is not one" in (
        _error_line(halt)
    )
