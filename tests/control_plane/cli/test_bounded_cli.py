"""Bounded inputs and paged listings as `skiff` users meet them: real processes, real server."""

from __future__ import annotations

import json
import os

import pytest

from contract.limits import MAX_NOTES
from control_plane.blobs import LocalBlobStore
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.cli.test_cli import _error_line, model_file, server, skiff  # noqa: F401


@pytest.mark.parametrize(
    ("ref", "words"),
    [
        ("det:²", "invalid version '²'"),  # str.isdigit() says yes, int() says no
        ("det:٣", "invalid version '٣'"),  # a decimal digit, but not an ASCII one
        ("det:99999999999", "use 1 to 2147483647"),
        ("det:0", "invalid version '0'"),
    ],
)
def test_bad_version_refs_exit_3_with_one_line(server, ref, words):  # noqa: F811
    for command in (("model", "show", ref), ("model", "pull", ref, "-o", "/tmp/never")):
        result = skiff(*command, env=server["env"], check=False)
        assert result.returncode == 3, result.stderr
        assert words in _error_line(result)
        assert "Traceback" not in result.stderr and result.stdout == ""


@pytest.mark.parametrize(
    ("notes", "words"),
    [
        ("\x1b[31mred", "notes must not contain control characters"),
        ("x" * (MAX_NOTES + 1), f"notes must be at most {MAX_NOTES} characters"),
    ],
)
def test_bad_notes_exit_3_with_one_line(server, model_file, notes, words):  # noqa: F811
    args = ("model", "push", str(model_file), "--name", "notes", "--notes", notes)
    result = skiff(*args, env=server["env"], check=False)
    assert result.returncode == 3, result.stderr
    assert words in _error_line(result)


def test_bad_reason_exits_3(server):  # noqa: F811
    result = skiff(
        "fleet", "revoke", "dev_0000", "--reason", "a\x07b", env=server["env"], check=False
    )
    assert result.returncode == 3 and "reason must not contain" in _error_line(result)


def test_ls_and_show_walk_every_page_unless_limited(server, model_file):  # noqa: F811
    env = server["env"]
    for name in ("page-a", "page-b", "page-c"):
        skiff("model", "push", str(model_file), "--name", name, env=env)
    skiff("model", "push", str(model_file), "--name", "page-a", "--allow-duplicate", env=env)

    everything = json.loads(skiff("model", "ls", "--json", env=env).stdout)
    assert everything["more"] is False
    names = [m["name"] for m in everything["models"]]
    assert {"page-a", "page-b", "page-c"} <= set(names) and names == sorted(names)

    limited = skiff("model", "ls", "--limit", "2", "--json", env=env)
    assert json.loads(limited.stdout) == {
        "models": everything["models"][:2],
        "more": True,  # the document says it was cut short, as stderr does
    }
    assert "showing the first 2 models; more exist" in limited.stderr
    whole = skiff("model", "ls", "--limit", str(len(names)), env=env)
    assert whole.stderr == "" and all(name in whole.stdout for name in names)

    shown = json.loads(skiff("model", "show", "page-a", "--limit", "1", "--json", env=env).stdout)
    assert [v["version"] for v in shown["versions"]] == [1] and shown["more"] is True
    both = json.loads(skiff("model", "show", "page-a", "--json", env=env).stdout)
    assert [v["version"] for v in both["versions"]] == [1, 2] and both["more"] is False

    negative = skiff("model", "ls", "--limit", "-1", env=env, check=False)
    assert negative.returncode == 3 and "--limit -1 is negative" in _error_line(negative)


def test_gc_lists_then_deletes_old_orphans(server):  # noqa: F811
    env = server["env"]
    blobs = LocalBlobStore(server["home"] / "blobs")
    old = blobs.put_stream([b"orphaned by a crash"]).key
    path = blobs.root / old[:2] / old[2:4] / old
    os.utime(path, (0, 0))  # 1970: older than any grace period
    young = blobs.put_stream([b"a push in flight"]).key

    dry = json.loads(skiff("gc", "--dry-run", "--json", env=env).stdout)
    assert dry == {"dry_run": True, "blobs": [old], "bytes": 19, "kept_young": 1}
    assert path.exists()
    text = skiff("gc", env=env).stdout
    assert f"deleted 1 unreferenced blobs (19 bytes)\n  {old}\n" in text
    assert "kept 1 younger than the grace period" in text
    assert not path.exists() and blobs.exists(young)
    again = json.loads(skiff("gc", "--json", env=env).stdout)
    assert again["blobs"] == [] and again["kept_young"] == 1


def test_fleet_ls_limit(server):  # noqa: F811
    env = server["env"]
    token = skiff("token", "create", "--enroll", env=env).stdout.strip()
    ids = sorted(
        Device.enroll(env["SKIFF_SERVER"], token, {"region": "paged"}).id for _ in range(3)
    )
    everything = json.loads(
        skiff("fleet", "ls", "--select", "region=paged", "--json", env=env).stdout
    )
    assert [d["id"] for d in everything["devices"]] == ids and everything["more"] is False
    limited = skiff("fleet", "ls", "--select", "region=paged", "--limit", "2", "--json", env=env)
    cut = json.loads(limited.stdout)
    assert [d["id"] for d in cut["devices"]] == ids[:2] and cut["more"] is True
    assert "showing the first 2 devices; more exist" in limited.stderr
