"""The admin API end to end: real server on port 0, real MNN, real stores."""

from __future__ import annotations

import hashlib
import json
import logging

import boto3
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from contract import errors
from control_plane.crypto import verify_manifest
from control_plane.demo import sample_models
from control_plane.registry import registry as registry_module
from tests.control_plane.helpers import start_control_plane
from tests.control_plane.leaks import find_leaks


@pytest.fixture(scope="module")
def onnx_bytes() -> bytes:
    return sample_models.tiny_mlp_onnx(seed=1)


@pytest.fixture(scope="module")
def mnn_bytes(onnx_bytes) -> bytes:
    return sample_models.onnx_to_mnn_bytes(onnx_bytes)


def _s3_url(endpoint: str, bucket: str) -> str:
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/models?endpoint_url={endpoint}"


@pytest.fixture(params=["sqlite+file", pytest.param("postgresql+s3", marks=pytest.mark.postgres)])
def cp(request, tmp_path):
    settings = {}
    if request.param == "postgresql+s3":
        settings["db"] = request.getfixturevalue("pg_url")
        bucket = "skiff-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
        settings["blobs"] = _s3_url(request.getfixturevalue("moto_endpoint"), bucket)
    plane = start_control_plane(tmp_path / "home", **settings)
    yield plane
    plane.stop()


def _write(tmp_path, name: str, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


def test_push_onnx_with_variants_then_show_and_pull(cp, tmp_path, onnx_bytes):
    path = _write(tmp_path, "m.onnx", onnx_bytes)
    with cp.client() as client:
        v1 = client.push(path, name="det", notes="first", variants=("int8", "fp16"))
        assert (v1.model, v1.version, v1.source_format) == ("det", 1, "onnx")
        assert [v.name for v in v1.variants] == ["fp32", "int8", "fp16"]
        assert [t.name for t in v1.signature.inputs] == ["x"]
        assert list(v1.signature.inputs[0].shape) == [1, 16]
        assert v1.signature.mnn_version.startswith("3.6")
        assert v1.created_by == "admin" and v1.notes == "first"

        manifest = verify_manifest(
            v1.manifest, v1.manifest_signature, cp.registry.signer.public_key_pem()
        )
        assert manifest["model"] == "det" and manifest["version"] == 1
        assert set(manifest["variants"]) == {"fp32", "int8", "fp16"}

        for variant in v1.variants:
            out = tmp_path / f"pulled-{variant.name}.mnn"
            header = client.pull("det", 1, out, variant=variant.name, pins=cp.pins)
            data = out.read_bytes()
            assert hashlib.sha256(data).hexdigest() == variant.plaintext_sha256
            assert header.variant.name == variant.name

        v2 = client.push(path, name="det")
        assert v2.version == 2
        shown = client.get_model("det")
        assert [v.version for v in shown.versions] == [1, 2]
        assert shown.model.latest_version == 2
        assert [m.name for m in client.list_models()] == ["det"]


def test_mnn_push_round_trips_byte_for_byte(cp, tmp_path, mnn_bytes):
    path = _write(tmp_path, "m.mnn", mnn_bytes)
    with cp.client() as client:
        version = client.push(path, name="exact")
        client.pull("exact", None, tmp_path / "back.mnn", pins=cp.pins)
    assert version.source_format == "mnn"
    assert (tmp_path / "back.mnn").read_bytes() == mnn_bytes


def test_blob_store_holds_only_ciphertext(cp, tmp_path, mnn_bytes):
    with cp.client() as client:
        version = client.push(_write(tmp_path, "m.mnn", mnn_bytes), name="det")
    keys = set(cp.registry.blobs.keys())
    golden = version.golden.ciphertext_sha256
    assert keys == {v.ciphertext_sha256 for v in version.variants} | {golden}
    _, plain_golden = cp.registry.golden("det", version.version)
    stored = {key: b"".join(cp.registry.blobs.open_read(key)) for key in keys}
    assert len(stored[version.variants[0].ciphertext_sha256]) > len(mnn_bytes)
    # No 64-byte window of the model or of the golden data appears in the blob store.
    for plaintext in (mnn_bytes, plain_golden):
        for offset in range(0, len(plaintext) - 64, 1024):
            assert all(plaintext[offset : offset + 64] not in blob for blob in stored.values())


def _assert_nothing_stored(cp):
    assert cp.registry.store.list_models() == []
    assert list(cp.registry.blobs.keys()) == []


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        (b"", "model file is empty"),
        (b"\x00" * 10 + bytes(range(256)) * 20, "MNN model|unrecognised"),
        ("truncated", "MNN model"),
        ("bad-onnx", "ONNX model could not be converted"),
    ],
)
def test_bad_models_are_rejected_and_leave_nothing(cp, tmp_path, mnn_bytes, payload, match):
    if payload == "truncated":
        payload = mnn_bytes[: len(mnn_bytes) // 2]
    elif payload == "bad-onnx":
        payload = sample_models.unconvertible_onnx()
    with cp.client() as client, pytest.raises(errors.InvalidArgument, match=match):
        client.push(_write(tmp_path, "bad", payload), name="det")
    _assert_nothing_stored(cp)
    with cp.client() as client:
        assert client.push(_write(tmp_path, "ok.mnn", mnn_bytes), name="det").version == 1


@pytest.mark.parametrize("name", ["", "Det", "has space", "x" * 65, "../etc", "é"])
def test_invalid_names(cp, tmp_path, mnn_bytes, name):
    with cp.client() as client, pytest.raises(errors.InvalidArgument, match="invalid model name"):
        client.push(_write(tmp_path, "m.mnn", mnn_bytes), name=name)
    _assert_nothing_stored(cp)


def test_unknown_model_version_and_variant(cp, tmp_path, mnn_bytes):
    with cp.client() as client:
        with pytest.raises(errors.NotFound, match="'ghost' not found"):
            client.get_model("ghost")
        client.push(_write(tmp_path, "m.mnn", mnn_bytes), name="det")
        with pytest.raises(errors.NotFound, match="det:7 not found"):
            client.get_model("det", 7)
        with pytest.raises(errors.NotFound, match="det:7 not found"):
            client.pull("det", 7, tmp_path / "x.mnn", pins=cp.pins)
        with pytest.raises(errors.NotFound, match="no variant 'int4'"):
            client.pull("det", 1, tmp_path / "x.mnn", variant="int4", pins=cp.pins)
    assert not (tmp_path / "x.mnn").exists()


@pytest.mark.parametrize("token", ["", "skf_wrong"])
def test_every_admin_call_needs_the_token(cp, tmp_path, mnn_bytes, token):
    path = _write(tmp_path, "m.mnn", mnn_bytes)
    with cp.client(token) as client:
        calls = [
            lambda: client.push(path, name="det"),
            client.list_models,
            lambda: client.get_model("det"),
            lambda: client.pull("det", 1, tmp_path / "out.mnn", pins=cp.pins),
            client.rotate_kek,
        ]
        for call in calls:
            with pytest.raises(errors.Unauthenticated):
                call()
    _assert_nothing_stored(cp)


def test_health_and_reflection_are_served(cp):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with cp.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="skiff.v1.AdminService"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        services = ProtoReflectionDescriptorDatabase(channel).get_services()
        assert "skiff.v1.AdminService" in services


def test_rotate_local_kek_rewraps_without_touching_blobs(cp, tmp_path, mnn_bytes):
    path = _write(tmp_path, "m.mnn", mnn_bytes)
    with cp.client() as client:
        client.push(path, name="det")
        client.push(path, name="det", allow_duplicate=True)
        blobs_before = {
            k: b"".join(cp.registry.blobs.open_read(k)) for k in cp.registry.blobs.keys()
        }
        wrapped_before = [v.data_key for v in cp.registry.store.list_versions("det")]
        result = client.rotate_kek()
        assert result.rewrapped == 2 and result.old_kek_id != result.new_kek_id
        wrapped_after = [v.data_key for v in cp.registry.store.list_versions("det")]
        assert {w.kek_id for w in wrapped_after} == {result.new_kek_id}
        assert all(
            a.ciphertext != b.ciphertext for a, b in zip(wrapped_before, wrapped_after, strict=True)
        )
        blobs_after = {
            k: b"".join(cp.registry.blobs.open_read(k)) for k in cp.registry.blobs.keys()
        }
        assert blobs_after == blobs_before
        client.pull("det", 1, tmp_path / "back.mnn", pins=cp.pins)
    assert (tmp_path / "back.mnn").read_bytes() == mnn_bytes
    keyset = json.loads((cp.config.home / "keys" / "kek.json").read_text())
    assert len(keyset["key"]) == 1  # the old key was retired once nothing used it


def test_secrets_and_plaintext_never_reach_the_logs(
    cp, tmp_path, mnn_bytes, caplog, capfd, monkeypatch
):
    caplog.set_level(logging.DEBUG)
    captured = []
    real_new_data_key = registry_module.new_data_key

    def spy() -> bytes:
        captured.append(real_new_data_key())
        return captured[-1]

    monkeypatch.setattr(registry_module, "new_data_key", spy)
    with cp.client() as client:
        client.push(_write(tmp_path, "m.mnn", mnn_bytes), name="det")
        client.pull("det", 1, tmp_path / "back.mnn", pins=cp.pins)
        client.rotate_kek()
        with cp.client("skf_" + "x" * 43) as bad, pytest.raises(errors.Unauthenticated):
            bad.list_models()
    out, err = capfd.readouterr()
    # caplog.text is every record as formatted, tracebacks included; plus the process's
    # own stdout/stderr (MNN children and native code write there).
    text = "\n".join([caplog.text, *(r.getMessage() for r in caplog.records), out, err])
    assert "pushed det:1" in text  # the logs are captured at all
    assert cp.token not in text and "x" * 43 not in text
    assert len(captured) == 1
    # Raw, hex, base64 (any alignment), repr: of the keyset and of the AES key inside.
    # tests/control_plane/test_leaks.py shows this check catches a key that is logged.
    assert find_leaks(text, captured[0]) == []
    assert mnn_bytes[100:164].hex() not in text
