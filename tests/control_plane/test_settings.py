"""Settings: where each value came from, and what `skiff.json` may keep of it."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess
import sys

import pytest

from control_plane.settings import CONFIG_FILE, load_config, write_config_file

SKIFF = [sys.executable, "-m", "control_plane.cli"]


def _stored(home) -> dict:
    return json.loads((home / CONFIG_FILE).read_text())


@pytest.mark.postgres
def test_init_never_persists_an_environment_password(tmp_path, pg_url):
    home = tmp_path / "home"
    with_password = pg_url.replace("postgres@", "postgres:s3cr3t-pw@", 1)  # trust auth ignores it
    env = {
        **os.environ,
        "SKIFF_DB": with_password,
        "SKIFF_MAX_MODEL_BYTES": "12345",
        "SKIFF_TOKEN": "",
    }
    result = subprocess.run(
        [*SKIFF, "init", "--home", str(home), "--grpc", "127.0.0.1:7999"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    path = home / CONFIG_FILE
    assert "s3cr3t" not in path.read_text()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    stored = _stored(home)
    assert stored["grpc"] == "127.0.0.1:7999"  # a flag: kept
    assert "db" not in stored and "max_model_bytes" not in stored  # the environment's: not
    # The environment still decides while it is set.
    assert load_config(home, environ={"SKIFF_DB": with_password}).db == with_password


def test_only_flag_file_and_changed_values_are_written(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / CONFIG_FILE).write_text(json.dumps({"presign_ttl_s": 60}))
    environ = {"SKIFF_DB": "postgresql://u:pw@db/x", "SKIFF_POLL_INTERVAL_S": "9"}
    config = load_config(home, {"grpc": "127.0.0.1:1"}, environ=environ)
    assert (config.db, config.poll_interval_s, config.presign_ttl_s) == (
        "postgresql://u:pw@db/x",
        9,
        60,
    )
    write_config_file(config)
    assert _stored(home) == {"grpc": "127.0.0.1:1", "presign_ttl_s": 60}
    # A value changed after loading (a KEK rotation moving to KMS) is the server's own
    # decision: it is written, and the environment's values still are not.
    write_config_file(dataclasses.replace(config, kek="aws-kms://alias/new"))
    assert _stored(home) == {
        "grpc": "127.0.0.1:1",
        "presign_ttl_s": 60,
        "kek": "aws-kms://alias/new",
    }


def test_config_file_is_private_and_written_through_a_fresh_temp_file(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    # The old fixed temp name, planted as a symlink: writing must not follow it.
    (home / "skiff.tmp").symlink_to(victim)
    old_umask = os.umask(0)
    try:
        write_config_file(load_config(home, {"grpc": "127.0.0.1:2"}, environ={}))
    finally:
        os.umask(old_umask)
    path = home / CONFIG_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not path.is_symlink()
    assert victim.read_text() == "untouched"
    assert sorted(p.name for p in home.iterdir()) == ["skiff.json", "skiff.tmp"]
    # A symlink planted at the config file itself is replaced, never written through.
    config = load_config(home, {"grpc": "127.0.0.1:3"}, environ={})
    path.unlink()
    path.symlink_to(victim)
    write_config_file(config)
    assert not path.is_symlink() and _stored(home) == {"grpc": "127.0.0.1:3"}
    assert victim.read_text() == "untouched"
