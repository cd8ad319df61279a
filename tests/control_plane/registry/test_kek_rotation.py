"""KEK rotation that fails, is killed, or runs while others write: no model is ever lost.

Real servers (in-process and `skiff server` processes), SQLite, and moto's KMS over HTTP.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from pathlib import Path

import boto3
import pytest

from contract import errors
from control_plane.api.client import AdminClient
from control_plane.app import build_app, kek_rotation
from control_plane.demo import sample_models
from control_plane.home import read_token
from control_plane.pins import read_pins
from control_plane.serve import create_server
from control_plane.settings import CONFIG_FILE, load_config
from control_plane.store.sql_store import SqlStore
from tests.control_plane.cli.test_cli import skiff
from tests.control_plane.helpers import ControlPlane, spawn_server, start_control_plane, tls_of

MODELS = ("det", "cls", "seg")


@pytest.fixture(scope="module")
def mnn_files(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("models")
    files = {}
    for seed, name in enumerate(MODELS):
        files[name] = folder / f"{name}.mnn"
        files[name].write_bytes(
            sample_models.onnx_to_mnn_bytes(sample_models.tiny_mlp_onnx(seed=seed))
        )
    return files


@pytest.fixture
def kms(moto_endpoint):
    return boto3.client("kms", endpoint_url=moto_endpoint, region_name="us-east-1")


def _deny_all(kms) -> str:
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Deny", "Principal": "*", "Action": "kms:*", "Resource": "*"}],
    }
    return kms.create_key(Policy=json.dumps(policy))["KeyMetadata"]["KeyId"]


def _start(tmp_path: Path, moto_endpoint: str) -> ControlPlane:
    return start_control_plane(
        tmp_path / "home", kms_endpoint=moto_endpoint, kms_region="us-east-1"
    )


def _reopen(home: Path) -> ControlPlane:
    """Start another in-process server on an existing home, as a restart would."""
    config = load_config(home, {"grpc": "127.0.0.1:0"}, environ={})
    app = build_app(config)
    server, port = create_server(config, app, "127.0.0.1:0")
    server.start()
    return ControlPlane(config, app, server, port, read_token(home))


def _push_all(client: AdminClient, files: dict[str, Path]) -> None:
    for name, path in files.items():
        client.push(path, name=name)


def _assert_pulls_all(client: AdminClient, files: dict[str, Path], out: Path, home: Path) -> None:
    for name, path in files.items():
        client.pull(name, 1, out / f"{name}.back", pins=read_pins(home))
        assert (out / f"{name}.back").read_bytes() == path.read_bytes(), name


def _kek_ids(db_url: str) -> set[str]:
    store = SqlStore(db_url, migrate=False)
    try:
        return {v.data_key.kek_id for m in store.list_models() for v in store.list_versions(m.name)}
    finally:
        store.close()


def _config_file(home: Path) -> dict:
    return json.loads((home / CONFIG_FILE).read_text())


# -- a KMS that refuses ---------------------------------------------------------------


@pytest.mark.parametrize("refusal", ["denied", "missing"])
def test_a_refused_kms_rotation_changes_nothing(refusal, tmp_path, mnn_files, kms, moto_endpoint):
    key = _deny_all(kms) if refusal == "denied" else "alias/does-not-exist"
    plane = _start(tmp_path, moto_endpoint)
    home = plane.config.home
    try:
        with plane.client() as client:
            _push_all(client, {"det": mnn_files["det"]})
            before = _config_file(home)
            with pytest.raises(errors.SkiffError) as raised:
                client.rotate_kek(f"aws-kms://{key}")
        kind = errors.FailedPrecondition if refusal == "denied" else errors.NotFound
        assert isinstance(raised.value, kind), raised.value
        if refusal == "denied":
            assert "KMS refused" in str(raised.value)
            assert "AccessDeniedException" in str(raised.value)
        assert _config_file(home) == before
        assert _kek_ids(plane.config.db) == {plane.registry.kek.kek_id}
    finally:
        plane.stop()
    again = _reopen(home)  # a restart still reads every model
    try:
        with again.client() as client:
            _assert_pulls_all(client, {"det": mnn_files["det"]}, tmp_path, again.config.home)
    finally:
        again.stop()


def test_kms_refusal_through_the_cli_is_not_an_auth_failure(tmp_path, kms, moto_endpoint):
    plane = _start(tmp_path, moto_endpoint)
    plane.stop()  # only the initialised home is needed: a real `skiff server` serves it
    proc, address = spawn_server(plane.config.home)
    env = {"SKIFF_HOME": str(plane.config.home), "SKIFF_SERVER": address, "SKIFF_TOKEN": ""}
    try:
        result = skiff("key", "rotate", "--to", f"aws-kms://{_deny_all(kms)}", env=env, check=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    assert result.returncode == 7, result.stderr  # a conflict with the server's state
    assert "KMS refused" in result.stderr and "AccessDeniedException" in result.stderr
    assert "token" not in result.stderr.lower()


# -- the endpoint is the server's -----------------------------------------------------


def test_a_request_cannot_choose_the_kms_endpoint_or_a_key_file(tmp_path, kms, moto_endpoint):
    key = kms.create_key()["KeyMetadata"]["KeyId"]
    plane = _start(tmp_path, moto_endpoint)
    try:
        with plane.client() as client:
            for option in ("endpoint_url=http://127.0.0.1:9", "region=eu-west-1"):
                with pytest.raises(errors.InvalidArgument, match="kms_endpoint"):
                    client.rotate_kek(f"aws-kms://{key}?{option}")
            with pytest.raises(errors.InvalidArgument, match="aws-kms://KEY"):
                client.rotate_kek(str(plane.config.home / "keys" / "kek.json"))
            # The server's own endpoint works.
            assert client.rotate_kek(f"aws-kms://{key}").new_kek_id == f"aws-kms:{key}"
    finally:
        plane.stop()


def test_a_config_naming_a_kms_endpoint_in_the_url_is_refused_at_start(
    tmp_path, kms, moto_endpoint
):
    key = kms.create_key()["KeyMetadata"]["KeyId"]
    plane = _start(tmp_path, moto_endpoint)
    plane.stop()
    home = plane.config.home
    config = _config_file(home)
    config["kek_keyring"] = [f"aws-kms://{key}?endpoint_url=http://127.0.0.1:9"]
    (home / CONFIG_FILE).write_text(json.dumps(config))
    with pytest.raises(errors.InvalidArgument, match="kms_endpoint and kms_region"):
        _reopen(home)


# -- other writers during a rotation --------------------------------------------------


def test_writers_keep_working_during_a_rotation(tmp_path, mnn_files, kms, moto_endpoint):
    key = kms.create_key()["KeyMetadata"]["KeyId"]
    plane = _start(tmp_path, moto_endpoint)
    first_batch, release = threading.Event(), threading.Event()

    def hold_after_first_batch(moved: int) -> None:
        if moved == 1:
            first_batch.set()
            assert release.wait(60)

    rotation = kek_rotation(plane.config, plane.registry, batch_size=1)
    result = {}

    def rotate() -> None:
        try:
            result["done"] = rotation.run(f"aws-kms://{key}", progress=hold_after_first_batch)
        except BaseException as exc:
            result["error"] = exc
            first_batch.set()

    runner = threading.Thread(target=rotate)
    try:
        with plane.client() as client:
            _push_all(client, {n: mnn_files[n] for n in ("det", "cls")})
            runner.start()
            assert first_batch.wait(30)
            assert "error" not in result, result["error"]
            # Mid-rotation, with one batch committed: a push and other writes go through.
            client.push(mnn_files["seg"], name="seg")
            assert client.create_enrollment_token().token
            release.set()
            runner.join(60)
            assert result["done"].rewrapped == 3  # the push made meanwhile moved too
            assert _kek_ids(plane.config.db) == {f"aws-kms:{key}"}
            _assert_pulls_all(client, mnn_files, tmp_path, plane.config.home)
    finally:
        release.set()
        runner.join(60)
        plane.stop()


def test_a_push_landing_after_the_last_batch_is_moved_before_the_switch(
    tmp_path, mnn_files, kms, moto_endpoint, monkeypatch
):
    key = kms.create_key()["KeyMetadata"]["KeyId"]
    plane = _start(tmp_path, moto_endpoint)
    store = plane.registry.store
    real_activate, calls = store.activate_kek, []

    def push_first(kek_id: str, url: str) -> int:
        calls.append(kek_id)
        if len(calls) == 1:  # every batch is done; a push under the old KEK commits now
            with plane.client() as late:
                late.push(mnn_files["seg"], name="seg")
        return real_activate(kek_id, url)

    try:
        with plane.client() as client:
            _push_all(client, {n: mnn_files[n] for n in ("det", "cls")})
            monkeypatch.setattr(store, "activate_kek", push_first)
            assert client.rotate_kek(f"aws-kms://{key}").rewrapped == 3
            assert len(calls) == 2
            assert _kek_ids(plane.config.db) == {f"aws-kms:{key}"}
            _assert_pulls_all(client, mnn_files, tmp_path, plane.config.home)
    finally:
        plane.stop()


# -- a rotation killed halfway --------------------------------------------------------

# Runs a rotation to argv[2] for home argv[1] in this child process, and stops dead (for
# the test to SIGKILL) at argv[3]: after the first committed batch, or after the switch
# to the new KEK but before skiff.json records it.
_KILLED_ROTATION = """
import sys, threading
from pathlib import Path
from control_plane import app as server
from control_plane.settings import load_config

home, target, point = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
config = load_config(home, environ={})
registry = server.build_registry(config)
written = server.write_config_file
writes = []

def stop(where):
    print(where, flush=True)
    threading.Event().wait()

def write_config_file(new):
    writes.append(new)
    if point == "before-config" and len(writes) == 2:
        stop("switched")
    return written(new)

def progress(moved):
    if point == "mid-rewrap" and moved == 1:
        stop("batch")

server.write_config_file = write_config_file
server.kek_rotation(config, registry, batch_size=1).run(target, progress=progress)
print("finished", flush=True)
"""


@pytest.mark.parametrize("point", ["mid-rewrap", "before-config"])
def test_a_rotation_killed_halfway_loses_nothing_and_can_be_finished(
    point, tmp_path, mnn_files, kms, moto_endpoint
):
    key = kms.create_key()["KeyMetadata"]["KeyId"]
    plane = _start(tmp_path, moto_endpoint)
    home, db = plane.config.home, plane.config.db
    local_url = str(plane.config.kek)
    try:
        with plane.client() as client:
            _push_all(client, mnn_files)
        old_id = plane.registry.kek.kek_id
    finally:
        plane.stop()

    child = subprocess.Popen(
        [sys.executable, "-c", _KILLED_ROTATION, str(home), f"aws-kms://{key}", point],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout.readline().strip() in ("batch", "switched")
    finally:
        child.kill()  # SIGKILL: no cleanup, no lock release but the kernel's
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL

    # skiff.json still names the old KEK, and already holds the new one in its keyring.
    written = _config_file(home)
    # The home's own keyset is the default, which skiff.json leaves out until it changes.
    assert written.get("kek", local_url) == local_url
    assert written["kek_keyring"] == [f"aws-kms://{key}"]
    moved = _kek_ids(db)
    assert moved == ({old_id, f"aws-kms:{key}"} if point == "mid-rewrap" else {f"aws-kms:{key}"})

    log = tmp_path / "server.log"
    proc, address = spawn_server(home, stderr=log.open("w"))
    try:
        with AdminClient(address, read_token(home), tls_of(address)) as client:
            _assert_pulls_all(client, mnn_files, tmp_path, home)
            finished = client.rotate_kek(f"aws-kms://{key}")
            assert finished.rewrapped == (2 if point == "mid-rewrap" else 0)
            assert _kek_ids(db) == {f"aws-kms:{key}"}
            _assert_pulls_all(client, mnn_files, tmp_path, home)
    finally:
        proc.send_signal(signal.SIGTERM)
        # A stop may take its grace, the handlers' drain and the loop's join (about 25 s
        # by design) on a loaded machine; a stop that hangs says why in its log.
        try:
            assert proc.wait(timeout=60) == 0
        except subprocess.TimeoutExpired:
            proc.kill()
            raise AssertionError(f"the server did not stop: {log.read_text()[-3000:]}") from None
    written = _config_file(home)
    assert written["kek"] == f"aws-kms://{key}"
    assert written["kek_keyring"] == [local_url]


def test_a_models_chunk_secret_moves_with_its_data_keys(tmp_path, kms, moto_endpoint):
    """Each version keeps its model's chunk secret wrapped beside its data key: a rotation
    moves both, and the next push still derives the same chunks (the old KEK is gone)."""
    key = kms.create_key()["KeyMetadata"]["KeyId"]
    plane = _start(tmp_path, moto_endpoint)
    big = tmp_path / "big.mnn"  # converted once: each conversion stamps a fresh uuid
    big.write_bytes(sample_models.onnx_to_mnn_bytes(sample_models.sized_mlp_onnx(2 << 20, seed=11)))
    try:
        with plane.client() as client:
            client.push(big, name="big")
            assert kek_rotation(plane.config, plane.registry).run(f"aws-kms://{key}").rewrapped
            client.push(big, name="big", allow_duplicate=True)
        versions = plane.registry.store.list_versions("big")
        assert {v.chunk_secret.kek_id for v in versions} == {f"aws-kms:{key}"}
        one, two = (v.variant("fp32").chunks["table"] for v in versions)
        assert one == two and one["ids"]  # the same secret: the same chunks, stored once
    finally:
        plane.stop()
