from __future__ import annotations

import base64
import json
import logging
import os
import stat
import time
from pathlib import Path

import boto3
import pytest

from contract import errors
from control_plane.crypto import (
    AwsKmsKek,
    LocalKek,
    WrappedKey,
    new_data_key,
    open_kek,
    rewrap,
)

CONTEXT = "model/resnet/versions/3"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def key_values(path: Path) -> list[str]:
    return [key["keyData"]["value"] for key in json.loads(path.read_text())["key"]]


@pytest.fixture
def kek_path(tmp_path: Path) -> Path:
    return tmp_path / "kek.json"


@pytest.fixture
def local(kek_path: Path) -> LocalKek:
    return LocalKek.create(kek_path)


def test_create_writes_a_private_tink_keyset(local: LocalKek, kek_path: Path) -> None:
    assert mode_of(kek_path) == 0o600
    keyset = json.loads(kek_path.read_text())
    assert local.kek_id == f"local:{keyset['primaryKeyId']}"
    assert keyset["key"][0]["keyData"]["typeUrl"].endswith("AesGcmKey")
    assert [p.name for p in kek_path.parent.iterdir()] == ["kek.json"]  # no temp left


def test_create_refuses_to_overwrite(local: LocalKek, kek_path: Path) -> None:
    before = kek_path.read_bytes()
    with pytest.raises(errors.AlreadyExists):
        LocalKek.create(kek_path)
    assert kek_path.read_bytes() == before
    assert [p.name for p in kek_path.parent.iterdir()] == ["kek.json"]


def test_load_refuses_group_or_world_readable(local: LocalKek, kek_path: Path) -> None:
    os.chmod(kek_path, 0o644)
    with pytest.raises(errors.InvalidArgument) as raised:
        LocalKek.load(kek_path)
    assert str(kek_path) in str(raised.value)
    assert "0644" in str(raised.value)


def test_load_missing_file_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(errors.NotFound):
        LocalKek.load(tmp_path / "absent.json")


def test_wrap_unwrap_round_trip(local: LocalKek, kek_path: Path) -> None:
    data_key = new_data_key()
    wrapped = local.wrap(data_key, context=CONTEXT)
    assert wrapped.kek_id == local.kek_id
    assert data_key not in wrapped.ciphertext
    assert LocalKek.load(kek_path).unwrap(wrapped, context=CONTEXT) == data_key


def test_wrong_context_fails(local: LocalKek) -> None:
    wrapped = local.wrap(new_data_key(), context=CONTEXT)
    with pytest.raises(errors.IntegrityError):
        local.unwrap(wrapped, context="model/resnet/versions/4")
    with pytest.raises(errors.InvalidArgument):
        local.wrap(b"k", context="")


def test_foreign_kek_fails(local: LocalKek, tmp_path: Path) -> None:
    other = LocalKek.create(tmp_path / "other.json")
    wrapped = local.wrap(new_data_key(), context=CONTEXT)
    with pytest.raises(errors.IntegrityError, match=local.kek_id):
        other.unwrap(wrapped, context=CONTEXT)
    # Even relabelled as the other KEK's, the ciphertext does not authenticate.
    relabelled = WrappedKey(other.kek_id, wrapped.ciphertext)
    with pytest.raises(errors.IntegrityError):
        other.unwrap(relabelled, context=CONTEXT)


def test_secrets_stay_out_of_reprs_and_errors(local: LocalKek, kek_path: Path) -> None:
    data_key = new_data_key()
    wrapped = local.wrap(data_key, context=CONTEXT)
    (value,) = key_values(kek_path)
    texts = [repr(local), str(local), repr(wrapped)]
    with pytest.raises(errors.IntegrityError) as raised:
        local.unwrap(wrapped, context="wrong")
    texts.append(str(raised.value))
    for text in texts:
        assert value not in text
        assert base64.b64encode(data_key).decode() not in text
        assert repr(wrapped.ciphertext) not in text


def test_add_key_rewrap_retire(local: LocalKek, kek_path: Path) -> None:
    data_key = new_data_key()
    old_wrap = local.wrap(data_key, context=CONTEXT)

    added = local.add_key()
    assert added.kek_id != local.kek_id
    assert mode_of(kek_path) == 0o600
    assert len(key_values(kek_path)) == 2
    assert [p.name for p in kek_path.parent.iterdir()] == ["kek.json"]
    # Until the re-wrap is done, the file's primary (what a restart wraps with) stays.
    reloaded = LocalKek.load(kek_path)
    assert reloaded.kek_id == local.kek_id
    assert reloaded.holds(added.kek_id) and reloaded.holds(local.kek_id)
    assert reloaded.using(added.kek_id).kek_id == added.kek_id

    new_wrap = rewrap(old_wrap, old=reloaded, new=added, context=CONTEXT)
    assert new_wrap.kek_id == added.kek_id
    assert reloaded.unwrap(new_wrap, context=CONTEXT) == data_key

    added.retire_old_keys()
    assert len(key_values(kek_path)) == 1
    assert mode_of(kek_path) == 0o600
    after = LocalKek.load(kek_path)
    assert after.kek_id == added.kek_id
    assert after.unwrap(new_wrap, context=CONTEXT) == data_key
    with pytest.raises(errors.IntegrityError):
        after.unwrap(old_wrap, context=CONTEXT)
    with pytest.raises(errors.IntegrityError):
        added.unwrap(old_wrap, context=CONTEXT)


def test_retiring_a_key_the_file_no_longer_holds_is_refused(local: LocalKek) -> None:
    added = local.add_key()
    added.retire_old_keys()
    with pytest.raises(errors.FailedPrecondition, match="no longer holds"):
        local.retire_old_keys()
    with pytest.raises(errors.NotFound):
        local.using(added.kek_id + "0")


def test_open_kek_local_urls(local: LocalKek, kek_path: Path) -> None:
    assert open_kek(str(kek_path)).kek_id == local.kek_id
    assert open_kek(f"file://{kek_path}").kek_id == local.kek_id
    with pytest.raises(errors.InvalidArgument):
        open_kek("gcp-kms://projects/x")
    with pytest.raises(errors.InvalidArgument):
        open_kek("aws-kms://some-key?colour=blue")


@pytest.mark.parametrize(
    "url",
    [
        "aws-kms://some-key?endpoint_url=http://127.0.0.1:1",
        "aws-kms://some-key?region=eu-west-1",
        "aws-kms://some-key?endpoint_url=http://attacker.example&region=us-east-1",
        "aws-kms://some-key?",
    ],
)
def test_kms_urls_cannot_name_an_endpoint_or_region(url: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="kms_endpoint") as raised:
        open_kek(url, kms_endpoint="http://127.0.0.1:2", kms_region="us-east-1")
    assert "attacker" not in str(raised.value) and "127.0.0.1" not in str(raised.value)


# --- AWS KMS against moto's server over HTTP -------------------------------------------


@pytest.fixture(scope="module")
def kms_key_arn(moto_endpoint: str) -> str:
    kms = boto3.client("kms", endpoint_url=moto_endpoint, region_name="us-east-1")
    return kms.create_key(Description="skiff test KEK")["KeyMetadata"]["Arn"]


@pytest.fixture
def kms_kek(moto_endpoint: str, kms_key_arn: str) -> AwsKmsKek:
    return AwsKmsKek(kms_key_arn, endpoint_url=moto_endpoint)


def test_kms_wrap_unwrap(kms_kek: AwsKmsKek, kms_key_arn: str) -> None:
    data_key = new_data_key()
    wrapped = kms_kek.wrap(data_key, context=CONTEXT)
    assert wrapped.kek_id == kms_kek.kek_id == f"aws-kms:{kms_key_arn}"
    assert data_key not in wrapped.ciphertext
    assert kms_kek.unwrap(wrapped, context=CONTEXT) == data_key


def test_kms_wrong_context_fails(kms_kek: AwsKmsKek) -> None:
    wrapped = kms_kek.wrap(new_data_key(), context=CONTEXT)
    with pytest.raises(errors.IntegrityError):
        kms_kek.unwrap(wrapped, context="model/resnet/versions/4")


def test_rewrap_local_to_kms(local: LocalKek, kms_kek: AwsKmsKek) -> None:
    data_key = new_data_key()
    wrapped = local.wrap(data_key, context=CONTEXT)
    moved = rewrap(wrapped, old=local, new=kms_kek, context=CONTEXT)
    assert moved.kek_id == kms_kek.kek_id
    assert kms_kek.unwrap(moved, context=CONTEXT) == data_key


def test_open_kek_kms_url_uses_the_servers_kms_settings(moto_endpoint: str, kms_key_arn: str):
    kek = open_kek(f"aws-kms://{kms_key_arn}", kms_endpoint=moto_endpoint, kms_region="us-east-1")
    assert isinstance(kek, AwsKmsKek)
    assert kek.kek_id == f"aws-kms:{kms_key_arn}" and kek.url == f"aws-kms://{kms_key_arn}"
    assert kek.unwrap(kek.wrap(b"k" * 32, context=CONTEXT), context=CONTEXT) == b"k" * 32
    kek.check()
    unreachable = open_kek(f"aws-kms://{kms_key_arn}", kms_endpoint="http://127.0.0.1:1")
    with pytest.raises(errors.Unavailable):
        unreachable.wrap(b"k" * 32, context=CONTEXT)


def _deny_all_policy() -> str:
    return json.dumps(
        {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Deny", "Principal": "*", "Action": "kms:*", "Resource": "*"}],
        }
    )


def test_kms_refusal_is_a_failed_precondition_not_an_auth_error(moto_endpoint: str) -> None:
    kms = boto3.client("kms", endpoint_url=moto_endpoint, region_name="us-east-1")
    denied = kms.create_key(Policy=_deny_all_policy())["KeyMetadata"]["KeyId"]
    kek = AwsKmsKek(denied, endpoint_url=moto_endpoint, region="us-east-1")
    with pytest.raises(errors.FailedPrecondition, match="KMS refused.*AccessDeniedException"):
        kek.check()


def test_check_refuses_a_disabled_kms_key(moto_endpoint: str) -> None:
    kms = boto3.client("kms", endpoint_url=moto_endpoint, region_name="us-east-1")
    key_id = kms.create_key()["KeyMetadata"]["KeyId"]
    kms.disable_key(KeyId=key_id)
    kek = AwsKmsKek(key_id, endpoint_url=moto_endpoint, region="us-east-1")
    with pytest.raises(errors.FailedPrecondition, match="Disabled"):
        kek.check()


def test_kms_plaintext_stays_out_of_debug_logs(
    kms_kek: AwsKmsKek, caplog: pytest.LogCaptureFixture
) -> None:
    data_key = new_data_key()
    with caplog.at_level(logging.DEBUG):
        kms_kek.unwrap(kms_kek.wrap(data_key, context=CONTEXT), context=CONTEXT)
    assert any(r.name.startswith("botocore") for r in caplog.records)  # debug was on
    assert base64.b64encode(data_key).decode() not in caplog.text
    assert repr(data_key) not in caplog.text


def test_unreachable_kms_is_unavailable_quickly(moto_endpoint: str) -> None:
    kek = AwsKmsKek("alias/skiff", endpoint_url="http://127.0.0.1:1", region="us-east-1")
    started = time.monotonic()
    with pytest.raises(errors.Unavailable):
        kek.wrap(b"k" * 32, context=CONTEXT)
    with pytest.raises(errors.Unavailable):
        kek.unwrap(WrappedKey(kek.kek_id, b"x" * 64), context=CONTEXT)
    assert time.monotonic() - started < 10


def test_kms_unknown_key_is_not_found(moto_endpoint: str) -> None:
    kek = AwsKmsKek("alias/does-not-exist", endpoint_url=moto_endpoint, region="us-east-1")
    with pytest.raises(errors.NotFound):
        kek.wrap(b"k" * 32, context=CONTEXT)
