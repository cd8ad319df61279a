"""The `skiff` command as users and scripts run it: real processes, real server."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from control_plane.demo import sample_models
from tests.control_plane.helpers import spawn_server

SKIFF = [sys.executable, "-m", "control_plane.cli"]
# `skiff` as a terminal's shell starts it, for tests that press Ctrl-C: SIGINT at its
# default. A run started in the background of a script (`make test &`) has SIGINT ignored,
# its children inherit that, and Python keeps an inherited SIGINT ignored, as every
# program should: such a test would then wait for a Ctrl-C that never comes.
SKIFF_AT_A_TERMINAL = [
    sys.executable,
    "-c",
    "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])",
    *SKIFF[1:],
]


def skiff(
    *args: str, env: dict | None = None, check: bool = True, timeout: float = 120
) -> subprocess.CompletedProcess:
    process = subprocess.Popen(
        [*SKIFF, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {}), "PYTHONFAULTHANDLER": "1"},
    )
    out, err = ended(process, timeout, what=f"skiff {args}")
    result = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    if check and result.returncode != 0:
        raise AssertionError(f"skiff {args} failed ({result.returncode}): {result.stderr}")
    return result


def ended(process: subprocess.Popen, timeout: float = 60, *, what: str = "") -> tuple[str, str]:
    """Return what a command printed once it ended; if it hangs, fail with where it was.

    Started with PYTHONFAULTHANDLER=1, a Python command dumps every thread's stack on the
    SIGABRT sent here (seen once: a push that had printed its refusal never exited).
    """
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGABRT)
        _, err = process.communicate(timeout=30)
        raise AssertionError(f"{what or process.args} did not end in {timeout} s:\n{err}") from None


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    home = tmp_path_factory.mktemp("cli") / "home"
    init = skiff("init", "--home", str(home), "--json")
    made = json.loads(init.stdout)
    proc, address = spawn_server(home)
    env = {"SKIFF_HOME": str(home), "SKIFF_SERVER": address, "SKIFF_TOKEN": ""}
    yield {"home": home, "env": env, "init": made, "proc": proc}
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("models") / "det.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=5))
    return path


def _error_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("skiff: error: ")
    return lines[0]


def test_init_writes_private_token_and_never_prints_it(server):
    token_file = Path(server["init"]["token_file"])
    token = token_file.read_text().strip()
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token.startswith("skf_")
    assert token not in json.dumps(server["init"])
    again = skiff("init", "--home", str(server["home"]), check=False)
    assert again.returncode == 7
    assert "already initialised" in _error_line(again)


def test_push_ls_show_pull(server, model_file, tmp_path):
    env = server["env"]
    pushed = skiff(
        "model", "push", str(model_file), "--name", "clidet", "--variant", "int8", env=env
    )
    assert pushed.stdout.splitlines()[0] == "pushed clidet:1"
    listed = json.loads(skiff("model", "ls", "--json", env=env).stdout)["models"]
    assert {"name": "clidet", "latest_version": 1, "version_count": 1}.items() <= listed[0].items()
    shown = json.loads(skiff("model", "show", "clidet:1", "--json", env=env).stdout)
    version = shown["versions"][0]
    assert version["manifest"]["model"] == "clidet"
    assert [v["name"] for v in version["variants"]] == ["fp32", "int8"]
    assert "clidet:1" in skiff("model", "show", "clidet", env=env).stdout
    out = tmp_path / "pulled.mnn"
    pulled = json.loads(
        skiff(
            "model", "pull", "clidet:1", "--variant", "int8", "-o", str(out), "--json", env=env
        ).stdout
    )
    assert pulled["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert pulled["variant"] == "int8"


def test_push_json_is_clean_for_scripts(server, model_file):
    result = skiff(
        "model", "push", str(model_file), "--name", "jsondet", "--json", env=server["env"]
    )
    body = json.loads(result.stdout)  # nothing but the JSON document on stdout
    assert body["model"] == "jsondet" and body["version"] == 1


@pytest.mark.parametrize(
    ("args", "env", "code", "words"),
    [
        (("model", "show", "ghost"), {}, 4, "'ghost' not found"),
        (("model", "show", "Bad Name"), {}, 3, "invalid model name"),
        (("model", "pull", "ghost:1", "-o", "/tmp/x"), {}, 4, "not found"),
        (("model", "push", "/nonexistent.onnx", "--name", "det"), {}, 3, "cannot read"),
        (("model", "ls"), {"SKIFF_TOKEN": "skf_wrong"}, 5, "invalid token"),
        (("model", "ls"), {"SKIFF_SERVER": "127.0.0.1:1"}, 6, "unreachable"),
    ],
)
def test_errors_exit_non_zero_with_one_line(server, args, env, code, words):
    result = skiff(*args, env={**server["env"], **env}, check=False)
    assert result.returncode == code, result.stderr
    assert words in _error_line(result)
    assert result.stdout == ""


def test_bad_model_is_rejected(server, tmp_path):
    junk = tmp_path / "junk.mnn"
    junk.write_bytes(os.urandom(10_000))
    result = skiff("model", "push", str(junk), "--name", "junk", env=server["env"], check=False)
    assert result.returncode == 3
    assert "model" in _error_line(result)
    assert "junk" not in skiff("model", "ls", env=server["env"]).stdout


def test_key_rotate(server, model_file, tmp_path):
    env = server["env"]
    skiff("model", "push", str(model_file), "--name", "rotdet", env=env)
    rotated = json.loads(skiff("key", "rotate", "--json", env=env).stdout)
    assert rotated["rewrapped"] >= 1 and rotated["old_kek_id"] != rotated["new_kek_id"]
    skiff("model", "pull", "rotdet:1", "-o", str(tmp_path / "r.mnn"), env=env)
    assert (tmp_path / "r.mnn").stat().st_size > 0


# As root, CAP_SYS_PTRACE reads any process: only without capabilities (same user) does
# the dumpable flag decide. Non-root users have none to drop.
NO_CAPABILITIES = ["setpriv", "--bounding-set", "-all", "--inh-caps", "-all"]
_READ_ENVIRON = """
import sys
try:
    open(f"/proc/{sys.argv[1]}/environ", "rb").read()
except PermissionError:
    print("denied")
else:
    print("readable")
"""


def _environ_from_outside(pid: int, prefix: list[str]) -> str:
    return subprocess.run(
        [*prefix, sys.executable, "-c", _READ_ENVIRON, str(pid)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def test_server_writes_no_core_file_and_cannot_be_inspected(tmp_path):
    home = tmp_path / "home"
    skiff("init", "--home", str(home), "--json")
    prefix = NO_CAPABILITIES if os.geteuid() == 0 else []
    proc, _ = spawn_server(home, prefix=prefix)
    try:
        limits = Path(f"/proc/{proc.pid}/limits").read_text().splitlines()
        (core,) = [line.split()[4:6] for line in limits if line.startswith("Max core file size")]
        assert core == ["0", "0"]
        # An ordinary process of the same user and privileges is readable; the server is not.
        with subprocess.Popen([*prefix, "sleep", "30"]) as control:
            try:
                assert _environ_from_outside(control.pid, prefix) == "readable"
            finally:
                control.kill()
        assert _environ_from_outside(proc.pid, prefix) == "denied"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
