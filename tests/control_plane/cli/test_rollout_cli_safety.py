"""`skiff rollout` as an operator meets it: paused stays paused, a typo or an empty
selection is refused with the fix, `--dry-run` counts, and stages are numbered from 1."""

from __future__ import annotations

import json

from tests.control_plane.api.device_helpers import Device
from tests.control_plane.cli.test_cli import _error_line, model_file, server, skiff  # noqa: F401


def test_rollout_words_and_refusals_from_the_command_line(server, model_file):  # noqa: F811
    env = server["env"]
    skiff("model", "push", str(model_file), "--name", "safe", env=env)
    token = skiff("token", "create", "--enroll", "--uses", "0", env=env).stdout.strip()
    for _ in range(6):
        Device.enroll(env["SKIFF_SERVER"], token, {"platform": "android"})

    # A typo names the key it most likely meant, in `fleet ls` as in `rollout create`.
    for args in (("fleet", "ls"), ("rollout", "create", "safe:1")):
        typo = skiff(*args, "--select", "platfrom=android", env=env, check=False)
        assert typo.returncode == 3, typo.stderr
        assert "did you mean `platform`?" in _error_line(typo) and typo.stdout == ""
    empty = skiff("rollout", "create", "safe:1", "--select", "platform=ios", env=env, check=False)
    assert empty.returncode == 7 and "--allow-empty" in _error_line(empty)

    # A dry run counts what it would select, and creates nothing.
    plan = ("rollout", "create", "safe:1", "--select", "platform=android", "--stages", "50,100")
    text = skiff(*plan, "--dry-run", env=env).stdout
    assert text.startswith("dry run: nothing created.")
    assert "would select 6 devices today" in text
    assert "  stage 2 of 2 (100%)  6 devices" in text and "  stage 1 of 2 (50%)  " in text
    doc = json.loads(skiff(*plan, "--dry-run", "--json", env=env).stdout)
    assert doc["dry_run"] is True and doc["selected"] == 6
    assert [(s["stage"], s["percent"]) for s in doc["stages"]] == [(1, 50.0), (2, 100.0)]
    assert doc["stages"][-1]["devices"] == 6 and doc["rollout"]["id"] == ""
    assert "no rollouts yet" in skiff("rollout", "ls", env=env).stdout

    rid = skiff(*plan, "--reason", "canary", env=env).stdout.strip()
    paused = skiff("rollout", "pause", rid, env=env).stdout
    assert paused.startswith(f"{rid}: paused: it stays at stage 1 of 2 (50%) until it is resumed")
    # A paused rollout stays paused: a promote is refused, naming the state and the fix.
    promote = skiff("rollout", "promote", rid, env=env, check=False)
    assert promote.returncode == 7 and promote.stdout == ""
    line = _error_line(promote)
    assert f"rollout {rid}: cannot promote a rollout that is paused" in line
    assert "resume it first" in line
    shown = skiff("rollout", "show", rid, env=env).stdout
    assert "  stage     stage 1 of 2 (50%)" in shown
    assert "neither its bake time nor a promote moves it on" in shown
    # Stages count from 1 ("in stage 0" is a device count: 6 random ids miss a 50% stage
    # one time in 64).
    assert "stage 0 of" not in shown and shown.count("stage 1 of 2 (50%)") >= 3  # + the audit
    doc = json.loads(skiff("rollout", "show", rid, "--json", env=env).stdout)
    assert (doc["state"], doc["stage"]) == ("paused", 1)
    assert [(e["action"], e["stage"]) for e in doc["audit"]] == [("create", 1), ("pause", 1)]

    resumed = skiff("rollout", "resume", rid, env=env).stdout
    assert f"{rid}: active again at stage 1 of 2 (50%)" in resumed
    promoted = skiff("rollout", "promote", rid, env=env).stdout
    assert f"{rid}: active at stage 2 of 2 (100%)" in promoted
    doc = json.loads(skiff("rollout", "show", rid, "--json", env=env).stdout)
    assert doc["stage"] == 2 and [e["stage"] for e in doc["audit"]] == [1, 1, 1, 2]
