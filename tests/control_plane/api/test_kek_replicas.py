"""Two `skiff server` processes on one PostgreSQL: a KEK rotation through one is safe for
pushes and pulls through the other, and two rotations never interleave."""

from __future__ import annotations

import signal

import boto3
import pytest

from contract import errors
from control_plane.api.client import AdminClient
from control_plane.demo import sample_models
from control_plane.home import init_home, read_token
from control_plane.pins import read_pins
from control_plane.settings import load_config
from control_plane.store.sql_store import SqlStore
from tests.control_plane.helpers import spawn_server, tls_of

pytestmark = pytest.mark.postgres


@pytest.fixture
def replicas(tmp_path, pg_url, moto_endpoint):
    home = tmp_path / "home"
    settings = {"db": pg_url, "kms_endpoint": moto_endpoint, "kms_region": "us-east-1"}
    init_home(load_config(home, settings, environ={}))
    procs = [spawn_server(home, "--replica"), spawn_server(home, "--replica")]
    clients = [AdminClient(address, read_token(home), tls_of(address)) for _, address in procs]
    for client in clients:
        client.pins = read_pins(home)  # what a CLI of this home verifies pulls against
    yield clients
    for client in clients:
        client.close()
    for proc, _ in procs:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


@pytest.fixture
def kms(moto_endpoint):
    return boto3.client("kms", endpoint_url=moto_endpoint, region_name="us-east-1")


def _kek_ids(pg_url: str) -> set[str]:
    store = SqlStore(pg_url, migrate=False)
    try:
        return {v.data_key.kek_id for m in store.list_models() for v in store.list_versions(m.name)}
    finally:
        store.close()


def _pulled(client: AdminClient, name: str, out) -> bytes:
    client.pull(name, 1, out, pins=client.pins)
    return out.read_bytes()


def test_a_rotation_on_one_replica_is_safe_for_the_other(replicas, pg_url, kms, tmp_path):
    a, b = replicas
    first, second = tmp_path / "first.onnx", tmp_path / "second.onnx"
    first.write_bytes(sample_models.tiny_mlp_onnx(seed=1))
    second.write_bytes(sample_models.tiny_mlp_onnx(seed=2))
    a.push(first, name="det")
    expected = _pulled(b, "det", tmp_path / "det.before")  # B has used the local KEK

    key = kms.create_key()["KeyMetadata"]["KeyId"]
    assert a.rotate_kek(f"aws-kms://{key}").rewrapped == 1
    # B's push wraps under the KEK that is active now, not the local one B still holds:
    # its insert is refused under the old KEK, and B reloads the KEK state and re-wraps.
    b.push(second, name="cls")
    assert _kek_ids(pg_url) == {f"aws-kms:{key}"}
    assert _pulled(b, "det", tmp_path / "det.after") == expected
    clsfile = _pulled(a, "cls", tmp_path / "cls.a")
    assert _pulled(b, "cls", tmp_path / "cls.b") == clsfile

    # And back the other way: a rotation through B, reads through A.
    other = kms.create_key()["KeyMetadata"]["KeyId"]
    assert b.rotate_kek(f"aws-kms://{other}").rewrapped == 2
    assert _kek_ids(pg_url) == {f"aws-kms:{other}"}
    assert _pulled(a, "det", tmp_path / "det.last") == expected


def test_two_rotations_never_interleave(replicas, pg_url, kms):
    a, b = replicas
    key = kms.create_key()["KeyMetadata"]["KeyId"]
    elsewhere = SqlStore(pg_url, migrate=False)  # a third process's rotation, mid-way
    try:
        with elsewhere.kek_rotation_lock():
            for client in (a, b):
                with pytest.raises(errors.FailedPrecondition, match="another KEK rotation"):
                    client.rotate_kek(f"aws-kms://{key}")
    finally:
        elsewhere.close()
    assert a.rotate_kek(f"aws-kms://{key}").new_kek_id == f"aws-kms:{key}"
