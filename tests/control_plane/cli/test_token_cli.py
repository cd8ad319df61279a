"""`skiff token create --role|ls|revoke` and a database without an admin token, as a
user meets them: real `skiff` processes against a real server."""

from __future__ import annotations

import json
import signal
import time

import pytest

from tests.control_plane.cli.test_cli import _error_line, model_file, server, skiff  # noqa: F401
from tests.control_plane.helpers import spawn_server


def _make(env: dict, role: str, *extra: str) -> dict:
    return json.loads(skiff("token", "create", "--role", role, *extra, "--json", env=env).stdout)


def test_each_role_does_its_job_and_no_more(server, model_file):  # noqa: F811
    env = server["env"]
    viewer = _make(env, "viewer", "--name", "dash")
    publisher = _make(env, "publisher", "--name", "ci")
    operator = _make(env, "operator")
    assert viewer["token"].startswith("skf_") and viewer["id"].startswith("tok_")
    assert viewer["role"] == "viewer" and viewer["expires_at"] is None
    assert operator["name"].startswith("operator-")

    as_viewer = {**env, "SKIFF_TOKEN": viewer["token"]}
    as_publisher = {**env, "SKIFF_TOKEN": publisher["token"]}
    as_operator = {**env, "SKIFF_TOKEN": operator["token"]}
    refused = skiff("model", "push", str(model_file), "--name", "rl", env=as_viewer, check=False)
    assert refused.returncode == 5
    assert "(dash) is viewer; `skiff model push` needs publisher" in _error_line(refused)
    assert skiff("model", "push", str(model_file), "--name", "rl", env=as_publisher).returncode == 0
    assert json.loads(skiff("model", "ls", "--json", env=as_viewer).stdout)
    # Versions record which token pushed them.
    shown = json.loads(skiff("model", "show", "rl:1", "--json", env=as_viewer).stdout)
    assert shown["versions"][0]["created_by"] == "ci"

    rollout = skiff(
        "rollout", "create", "rl:1", "--select", "platform=x", env=as_publisher, check=False
    )
    assert rollout.returncode == 5
    assert "(ci) is publisher; `skiff rollout create` needs operator" in _error_line(rollout)
    made = skiff(
        "rollout", "create", "rl:1", "--select", "platform=x", "--allow-empty", env=as_operator
    )
    assert made.stdout
    for who in (as_viewer, as_publisher, as_operator):
        made = skiff("token", "create", "--role", "admin", env=who, check=False)
        assert made.returncode == 5 and "needs admin" in _error_line(made)
        pull = skiff("model", "pull", "rl:1", "-o", "/tmp/never.mnn", env=who, check=False)
        assert pull.returncode == 5


def test_tokens_are_listed_expire_and_are_revoked(server):  # noqa: F811
    env = server["env"]
    short = _make(env, "viewer", "--ttl", "1s", "--name", "short")
    kept = _make(env, "viewer", "--name", "kept")
    listed = skiff("token", "ls", "--json", env=env).stdout
    assert short["token"] not in listed and kept["token"] not in listed  # never a secret
    rows = {t["id"]: t for t in json.loads(listed)["tokens"]}
    assert rows[kept["id"]]["role"] == "viewer" and rows[kept["id"]]["created_by"] == "admin"
    assert {"admin"} <= {t["name"] for t in rows.values()}

    time.sleep(1.2)
    expired = skiff("model", "ls", env={**env, "SKIFF_TOKEN": short["token"]}, check=False)
    assert expired.returncode == 5 and f"{short['id']} (short) is expired" in _error_line(expired)
    assert short["id"] not in skiff("token", "ls", env=env).stdout
    assert short["id"] in skiff("token", "ls", "--all", env=env).stdout

    as_kept = {**env, "SKIFF_TOKEN": kept["token"]}
    assert skiff("model", "ls", env=as_kept).returncode == 0
    assert "revoked" in skiff("token", "revoke", kept["id"], env=env).stdout
    revoked = skiff("model", "ls", env=as_kept, check=False)
    assert revoked.returncode == 5 and "is revoked" in _error_line(revoked)

    admin_id = next(t["id"] for t in rows.values() if t["name"] == "admin")
    last = skiff("token", "revoke", admin_id, env=env, check=False)
    assert last.returncode == 7 and "is the last admin token" in _error_line(last)
    ghost = skiff("token", "revoke", "tok_000000000000", env=env, check=False)
    assert ghost.returncode == 4


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--role", "root"), "invalid choice: 'root'"),
        (("--role", "viewer", "--enroll"), "not allowed with argument"),
        (("--role", "viewer", "--uses", "3"), "--uses and --attr apply to enrollment tokens"),
        (("--role", "viewer", "--name", "a b"), "invalid token name"),
        (("--role", "viewer", "--ttl", "soon"), "invalid duration"),
        (("--role", "viewer", "--ttl", "99999999999d"), "over the 10-year limit"),
        (("--role", "viewer", "--ttl", "9" * 30 + "d"), "over the 10-year limit"),
        (("--enroll", "--ttl", "9" * 30 + "d"), "over the 10-year limit"),
        (("--role", "viewer", "--db", "sqlite:///x.db"), "--db applies to --offline only"),
        (("--role", "admin", "--offline", "--db", "sqlite:////nonexistent/typo.db"), "no database"),
        (
            ("--role", "admin", "--offline", "--db", "postgresql://h:port/db"),
            "invalid database URL",
        ),
    ],
)
def test_bad_token_requests_get_one_line(server, args, words):  # noqa: F811
    result = skiff("token", "create", *args, env=server["env"], check=False)
    assert result.returncode in (2, 3, 4), result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr
    if result.returncode != 2:  # argparse's own errors come after its usage text
        _error_line(result)


@pytest.mark.postgres
def test_a_database_without_an_admin_token_says_what_to_do(tmp_path, pg_url):
    home = tmp_path / "home"
    skiff("init", "--home", str(home))  # its token lives in the home's SQLite database
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        proc, address = spawn_server(home, "--db", pg_url, stderr=stderr)
    try:
        env = {"SKIFF_HOME": str(home), "SKIFF_SERVER": address, "SKIFF_TOKEN": ""}
        refused = skiff("model", "ls", env=env, check=False)
        assert refused.returncode == 5
        line = _error_line(refused)
        assert "this server's database has no active admin token" in line
        assert "skiff token create --role admin --offline" in line
        assert pg_url.rsplit("/", 1)[-1] not in line  # callers learn no host or database...
        startup = log.read_text()
        assert "skiff token create --role admin --offline" in startup
        assert pg_url.rsplit("/", 1)[-1] in startup  # ...the server's own log does
        made = json.loads(
            skiff(
                "token", "create", "--role", "admin", "--offline", "--db", pg_url, "--json", env=env
            ).stdout
        )
        assert made["created_by"] == "token create --offline"
        ok = skiff("model", "ls", "--json", env={**env, "SKIFF_TOKEN": made["token"]})
        assert json.loads(ok.stdout) == {"models": [], "more": False}
        # ...and once a token exists, an unknown one is just invalid.
        assert "invalid token" in _error_line(skiff("model", "ls", env=env, check=False))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
