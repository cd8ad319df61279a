"""One conformance suite for every BlobStore, plus backend-specific edge cases."""

from __future__ import annotations

import datetime as dt
import hashlib
import stat
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest

from contract.errors import InvalidArgument, NotFound, Unavailable
from control_plane.blobs import (
    CHUNK_SIZE,
    BlobInfo,
    BlobStore,
    LocalBlobStore,
    S3BlobStore,
    open_blob_store,
)

MIB = 1024 * 1024


@dataclass
class Backend:
    store: BlobStore
    leftovers: Callable[[], list[str]]  # every file/object the backend holds, temp ones too
    take_away: Callable[[], None]  # makes the store unusable (root gone, bucket deleted)


def _files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _make_bucket(endpoint: str) -> tuple[object, str]:
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    bucket = f"skiff-test-{uuid.uuid4().hex[:12]}"
    s3.create_bucket(Bucket=bucket)
    return s3, bucket


def _all_objects(s3, bucket: str) -> list[str]:
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(obj["Key"] for page in pages for obj in page.get("Contents", ()))


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "local":
        root = tmp_path / "blobs"
        root.mkdir()
        return Backend(
            open_blob_store(root.as_uri()),
            lambda: _files_under(root),
            lambda: root.rename(tmp_path / "unmounted"),
        )
    endpoint = request.getfixturevalue("moto_endpoint")
    s3, bucket = _make_bucket(endpoint)
    spool = tmp_path / "spool"
    spool.mkdir()
    url = f"s3://{bucket}/models?endpoint_url={endpoint}&region=us-east-1"
    store = S3BlobStore.from_url(url, spool_dir=spool)

    def delete_bucket() -> None:
        for key in _all_objects(s3, bucket):
            s3.delete_object(Bucket=bucket, Key=key)
        s3.delete_bucket(Bucket=bucket)

    return Backend(store, lambda: _all_objects(s3, bucket) + _files_under(spool), delete_bucket)


def _data(size: int, seed: int = 0) -> bytes:
    return (hashlib.sha256(str(seed).encode()).digest() * (size // 32 + 1))[:size]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _chunked(data: bytes, size: int = 777_777) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


class Boom(Exception):
    pass


def _failing_stream(data: bytes, fail_after: int) -> Iterator[bytes]:
    for i, chunk in enumerate(_chunked(data, MIB)):
        if i == fail_after:
            raise Boom("source broke mid-stream")
        yield chunk


# --- conformance: every backend ------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 1000, 3 * MIB + 17, 9 * MIB + 1])
def test_put_stream_round_trips_under_its_sha256(backend: Backend, size: int) -> None:
    data = _data(size)
    info = backend.store.put_stream(_chunked(data))
    assert info == BlobInfo(key=_sha(data), size=size)
    assert b"".join(backend.store.open_read(info.key)) == data
    assert backend.store.stat(info.key) == info


def test_put_is_idempotent(backend: Backend) -> None:
    data = _data(5000, seed=2)
    first = backend.store.put_stream(_chunked(data, 1000))
    second = backend.store.put_stream(_chunked(data, 100))
    assert first == second
    assert list(backend.store.keys()) == [first.key]
    assert b"".join(backend.store.open_read(first.key)) == data


def test_put_stream_failing_midway_leaves_nothing(backend: Backend) -> None:
    with pytest.raises(Boom):
        backend.store.put_stream(_failing_stream(_data(4 * MIB), fail_after=2))
    assert list(backend.store.keys()) == []
    assert backend.leftovers() == []


@pytest.mark.parametrize("offset", [0, 1, MIB, MIB + 1, 5 * MIB // 2 - 1, 5 * MIB // 2])
def test_open_read_from_offset(backend: Backend, offset: int) -> None:
    data = _data(5 * MIB // 2, seed=4)
    key = backend.store.put_stream(_chunked(data)).key
    chunks = list(backend.store.open_read(key, offset=offset))
    assert b"".join(chunks) == data[offset:]
    assert all(0 < len(c) <= CHUNK_SIZE for c in chunks)


@pytest.mark.parametrize("offset", [-1, 101])
def test_open_read_rejects_offset_outside_blob(backend: Backend, offset: int) -> None:
    key = backend.store.put_stream([_data(100)]).key
    with pytest.raises(InvalidArgument):
        backend.store.open_read(key, offset=offset)


def test_stat_exists_delete_keys(backend: Backend) -> None:
    infos = [backend.store.put_stream([_data(10 + i, seed=i)]) for i in range(3)]
    assert sorted(backend.store.keys()) == sorted(i.key for i in infos)
    assert all(backend.store.exists(i.key) for i in infos)
    assert backend.store.stat(infos[1].key).size == 11

    backend.store.delete(infos[1].key)
    backend.store.delete(infos[1].key)  # a missing key is not an error
    assert not backend.store.exists(infos[1].key)
    with pytest.raises(NotFound):
        backend.store.stat(infos[1].key)
    assert sorted(backend.store.keys()) == sorted([infos[0].key, infos[2].key])


def test_list_blobs_gives_size_and_write_time(backend: Backend) -> None:
    # S3 keeps LastModified to the second; allow that much either side.
    before = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=2)
    infos = [backend.store.put_stream([_data(size, seed=size)]) for size in (0, 5, CHUNK_SIZE + 3)]
    after = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=2)
    listed = sorted(backend.store.list_blobs(), key=lambda b: b.key)
    assert [(b.key, b.size) for b in listed] == sorted((i.key, i.size) for i in infos)
    assert all(before <= b.modified <= after for b in listed)
    backend.store.delete(infos[0].key)
    assert sorted(b.key for b in backend.store.list_blobs()) == sorted(i.key for i in infos[1:])


def test_missing_blob_is_not_found(backend: Backend) -> None:
    missing = _sha(b"never stored")
    assert not backend.store.exists(missing)
    with pytest.raises(NotFound, match=missing):
        backend.store.stat(missing)
    with pytest.raises(NotFound, match=missing):
        backend.store.open_read(missing)
    with pytest.raises(NotFound):
        backend.store.open_read(missing, offset=5)


BAD_KEYS = ["", "ab", _sha(b"x").upper(), _sha(b"x")[:63], "g" * 64, "../" + "a" * 61, None]


@pytest.mark.parametrize("bad", BAD_KEYS)
@pytest.mark.parametrize("method", ["open_read", "stat", "exists", "delete"])
def test_invalid_keys_are_rejected(backend: Backend, method: str, bad: object) -> None:
    with pytest.raises(InvalidArgument, match="invalid blob key"):
        getattr(backend.store, method)(bad)


def test_check_passes_on_a_healthy_store_and_fails_without_it(backend: Backend) -> None:
    backend.store.put_stream([b"present"])
    assert backend.store.check() is None
    backend.take_away()
    with pytest.raises(Unavailable):
        backend.store.check()


# --- local backend -----------------------------------------------------------------


def test_local_layout_and_permissions(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    key = store.put_stream([b"hello"]).key
    path = tmp_path / key[:2] / key[2:4] / key
    assert path.read_bytes() == b"hello"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    for d in (path.parent, path.parent.parent, tmp_path / ".tmp"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert list((tmp_path / ".tmp").iterdir()) == []


def test_local_keys_skip_temp_and_stray_files(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path)
    key = store.put_stream([b"real"]).key
    (tmp_path / ".tmp" / "half-written").write_bytes(b"x")
    (tmp_path / "README").write_text("stray")
    misplaced = tmp_path / "00" / "00"
    misplaced.mkdir(parents=True)
    (misplaced / _sha(b"elsewhere")).write_bytes(b"elsewhere")
    assert list(store.keys()) == [key]


def test_local_missing_root_is_unavailable_and_not_created(tmp_path: Path) -> None:
    root = tmp_path / "unmounted"
    store = open_blob_store(str(root))
    key = _sha(b"x")
    for call in (store.check, lambda: store.stat(key), lambda: list(store.keys())):
        with pytest.raises(Unavailable, match="missing"):
            call()
    with pytest.raises(Unavailable, match="missing"):
        store.put_stream([b"x"])
    assert not root.exists()


def test_local_unusable_temp_dir_is_unavailable(tmp_path: Path) -> None:
    # A file squatting on .tmp makes the write path fail even for root.
    (tmp_path / ".tmp").write_bytes(b"")
    store = LocalBlobStore(tmp_path)
    with pytest.raises(Unavailable, match="temp file"):
        store.put_stream([b"x"])
    assert list(store.keys()) == []


# --- S3 backend ----------------------------------------------------------------------


def test_s3_object_layout_under_prefix(moto_endpoint: str) -> None:
    s3, bucket = _make_bucket(moto_endpoint)
    store = open_blob_store(f"s3://{bucket}/a/b/?endpoint_url={moto_endpoint}")
    key = store.put_stream([b"payload"]).key
    s3.put_object(Bucket=bucket, Key="a/b/stray.txt", Body=b"x")
    s3.put_object(Bucket=bucket, Key=f"a/b/00/{key}", Body=b"misplaced")
    assert _all_objects(s3, bucket) == sorted(
        [f"a/b/{key[:2]}/{key}", "a/b/stray.txt", f"a/b/00/{key}"]
    )
    assert list(store.keys()) == [key]


def test_s3_endpoint_falls_back_to_environment(
    moto_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, bucket = _make_bucket(moto_endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    store = open_blob_store(f"s3://{bucket}")
    key = store.put_stream([b"via env"]).key
    assert b"".join(store.open_read(key)) == b"via env"


OPERATIONS = ["check", "exists", "stat", "open_read", "delete", "keys", "put_stream"]


def _s3_operations(store: BlobStore) -> dict[str, Callable[[], object]]:
    key = _sha(b"x")
    return {
        "check": store.check,
        "exists": lambda: store.exists(key),
        "stat": lambda: store.stat(key),
        "open_read": lambda: store.open_read(key),
        "delete": lambda: store.delete(key),
        "keys": lambda: list(store.keys()),
        "put_stream": lambda: store.put_stream([b"x"]),
    }


@pytest.mark.parametrize("op", OPERATIONS)
def test_s3_unreachable_fails_fast(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    store = open_blob_store("s3://skiff-blobs?endpoint_url=http://127.0.0.1:1&region=us-east-1")
    started = time.monotonic()
    with pytest.raises(Unavailable, match="skiff-blobs.*unreachable"):
        _s3_operations(store)[op]()
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("op", OPERATIONS)
def test_s3_missing_bucket_is_unavailable(moto_endpoint: str, op: str) -> None:
    bucket = f"skiff-missing-{uuid.uuid4().hex[:12]}"
    store = open_blob_store(f"s3://{bucket}?endpoint_url={moto_endpoint}")
    with pytest.raises(Unavailable, match=f"{bucket}.*does not exist"):
        _s3_operations(store)[op]()


# --- factory -------------------------------------------------------------------------


def test_factory_picks_backend_by_scheme(tmp_path: Path) -> None:
    by_uri = open_blob_store(tmp_path.as_uri())
    by_path = open_blob_store(str(tmp_path))
    assert isinstance(by_uri, LocalBlobStore) and by_uri.root == tmp_path
    assert isinstance(by_path, LocalBlobStore) and by_path.root == tmp_path
    s3 = open_blob_store("s3://bucket/some/prefix/?region=eu-west-1&addressing_style=path")
    assert isinstance(s3, S3BlobStore)
    assert (s3.bucket, s3.prefix) == ("bucket", "some/prefix")


@pytest.mark.parametrize(
    "url",
    [
        "",
        "gs://bucket/prefix",
        "http://example.com/blobs",
        "file://otherhost/dir",
        "s3:///no-bucket",
        "s3://bucket?endpoint=http://typo",
        "s3://bucket?addressing_style=sideways",
        "s3://AKIDEXAMPLE:s3cr3t@bucket/prefix",
    ],
)
def test_factory_rejects_bad_urls_without_echoing_secrets(url: str) -> None:
    with pytest.raises(InvalidArgument) as err:
        open_blob_store(url)
    assert "s3cr3t" not in str(err.value)
