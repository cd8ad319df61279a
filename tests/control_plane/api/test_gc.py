"""Garbage collection of unreferenced blobs: never a referenced or a young one, safe in races."""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import threading
import time
import uuid

import boto3
import pytest

from contract import errors
from control_plane.app import build_registry
from control_plane.blobs import LocalBlobStore, S3BlobStore
from control_plane.registry import gc
from control_plane.store.sql_store import SqlStore
from tests.control_plane.helpers import start_control_plane
from tests.control_plane.store.test_store_conformance import _builder

DAY = 86_400


def _backdate(store: LocalBlobStore, key: str, seconds: float) -> None:
    """Make a local blob look `seconds` old (its mtime is what the sweep reads)."""
    path = store.root / key[:2] / key[2:4] / key
    when = time.time() - seconds
    os.utime(path, (when, when))


def _orphan(cp, content: bytes, *, age_s: float = 0) -> str:
    key = cp.registry.blobs.put_stream([content]).key
    if age_s:
        _backdate(cp.registry.blobs, key, age_s)
    return key


def _referenced(cp) -> set[str]:
    return cp.registry.store.referenced_blobs()


def test_grace_is_twice_the_longest_push():
    # 4 variants x (600 s of MNN + 2 GiB at 16 MiB/s) + 600 s of slack + 300 s to commit,
    # doubled.
    assert gc.longest_push_s(mnn_timeout_s=600, max_model_bytes=2 << 30) == 4 * 728 + 900
    assert gc.default_grace_s(mnn_timeout_s=600, max_model_bytes=2 << 30) == 2 * 3812


def test_old_orphans_go_young_and_referenced_blobs_stay(published):
    cp = published
    referenced = _referenced(cp)
    assert len(referenced) == 5  # det:1 fp32 + golden, det:2 fp32 + int8 + golden
    for key in referenced:  # however old, a referenced blob is never collected
        _backdate(cp.registry.blobs, key, 30 * DAY)
    content = b"crashed between blob write and commit"
    old = _orphan(cp, content, age_s=cp.registry.gc_grace_s + 60)
    young = _orphan(cp, b"a push still in flight")

    with cp.client() as client:
        dry = client.collect_garbage(dry_run=True)
        assert (list(dry.blobs), dry.bytes, dry.kept_young) == ([old], len(content), 1)
        assert cp.registry.blobs.exists(old)
        done = client.collect_garbage()
        assert (list(done.blobs), done.kept_young) == ([old], 1)
        assert not cp.registry.blobs.exists(old) and cp.registry.blobs.exists(young)
        assert set(cp.registry.blobs.keys()) == referenced | {young}
        for version in (1, 2):
            client.pull("det", version, cp.config.home / f"det{version}.mnn", pins=cp.pins)
            # Golden data is referenced too: the sweep kept it.
            client.pull("det", version, cp.config.home / f"g{version}", pins=cp.pins, golden=True)
        assert list(client.collect_garbage().blobs) == []


def test_a_sweep_on_another_replica_mid_push_keeps_the_push_s_blobs(cp, onnx_path, monkeypatch):
    # Replica B pushes; replica A (its own store connections, same database and blob
    # store) sweeps after B wrote its blobs and before B committed the row.
    replica_a = build_registry(cp.config)
    store_b = cp.registry.store
    real_create = store_b.create_version
    seen = {}

    def sweep_then_commit(model, build):
        seen["blobs"] = set(cp.registry.blobs.keys())
        seen["sweep"] = replica_a.collect_garbage()
        return real_create(model, build)

    monkeypatch.setattr(store_b, "create_version", sweep_then_commit)
    try:
        with cp.client() as client:
            version = client.push(onnx_path, name="det", variants=("int8",))
            pushed = {v.ciphertext_sha256 for v in version.variants}
            pushed.add(version.golden.ciphertext_sha256)
            assert seen["blobs"] == pushed  # the sweep ran in the window
            assert seen["sweep"].blobs == () and seen["sweep"].kept_young == 3
            client.pull("det", 1, cp.config.home / "det.mnn", variant="int8", pins=cp.pins)
    finally:
        replica_a.store.close()


def test_concurrent_sweeps_and_pushes_lose_nothing(cp, onnx_path):
    replica_a = build_registry(cp.config)
    olds = [
        _orphan(cp, f"orphan {i}".encode(), age_s=cp.registry.gc_grace_s + 1) for i in range(20)
    ]
    results, failures = [], []

    def run(call):
        try:
            results.append(call())
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            failures.append(exc)

    with cp.client() as client:
        calls = [
            replica_a.collect_garbage,
            cp.registry.collect_garbage,
            client.collect_garbage,
            lambda: client.push(onnx_path, name="det", allow_duplicate=True),
            lambda: client.push(onnx_path, name="det", allow_duplicate=True),
        ]
        threads = [threading.Thread(target=run, args=(call,)) for call in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        replica_a.store.close()
        assert failures == []
        assert not any(cp.registry.blobs.exists(key) for key in olds)
        assert set(cp.registry.blobs.keys()) == _referenced(cp)
        assert len(_referenced(cp)) == 4  # two versions: fp32 + golden data each
        for version in (1, 2):
            client.pull("det", version, cp.config.home / f"det{version}.mnn", pins=cp.pins)


def test_a_push_slower_than_half_the_grace_fails_and_leaves_nothing(tmp_path, onnx_path):
    plane = start_control_plane(tmp_path / "home", gc_grace_s=0.001)
    try:
        with plane.client() as client, pytest.raises(errors.Unavailable, match="grace period"):
            client.push(onnx_path, name="det")
        assert plane.registry.store.list_models() == []
        assert list(plane.registry.blobs.keys()) == []
    finally:
        plane.stop()


def test_the_server_sweeps_on_its_own(tmp_path):
    plane = start_control_plane(tmp_path / "home", gc_interval_s=0.2)
    try:
        old = _orphan(plane, b"left by a crash", age_s=plane.registry.gc_grace_s + 1)
        deadline = time.monotonic() + 20
        while plane.registry.blobs.exists(old) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not plane.registry.blobs.exists(old)
    finally:
        plane.stop()


def test_s3_orphans_go_by_last_modified_and_referenced_blobs_stay(tmp_path, moto_endpoint):
    bucket = f"skiff-gc-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=moto_endpoint).create_bucket(Bucket=bucket)
    blobs = S3BlobStore.from_url(f"s3://{bucket}/models?endpoint_url={moto_endpoint}")
    store = SqlStore(f"sqlite:///{tmp_path / 'skiff.db'}")
    try:
        kept = blobs.put_stream([b"ciphertext of det:1"]).key
        build = _builder("s3")

        def pointing_at_kept(number: int):
            made = build(number)
            variant = dataclasses.replace(made.variants[0], ciphertext_sha256=kept)
            return dataclasses.replace(made, variants=(variant,))

        store.create_version("det", pointing_at_kept)
        orphan = blobs.put_stream([b"orphan"]).key
        now = dt.datetime.now(dt.UTC)
        young = gc.collect_garbage(store, blobs, grace_s=3600, clock=lambda: now)
        assert (young.blobs, young.kept_young) == ((), 1)
        later = now + dt.timedelta(days=30)
        swept = gc.collect_garbage(store, blobs, grace_s=3600, clock=lambda: later)
        assert (swept.blobs, swept.bytes, swept.kept_young) == ((orphan,), 6, 0)
        assert list(blobs.keys()) == [kept]
    finally:
        store.close()


def test_a_sweep_keeps_every_chunk_a_version_names_and_takes_old_orphan_chunks(cp, tmp_path):
    """Chunks are blobs shared by a model's versions: every one a committed version's table
    names stays however old; an orphan chunk (a failed push's) goes once old; and a push
    that needs a chunk a sweep took stores it again."""
    from contract import chunks
    from control_plane.demo import sample_models

    big = tmp_path / "big.mnn"
    big.write_bytes(sample_models.onnx_to_mnn_bytes(sample_models.sized_mlp_onnx(2 << 20, seed=21)))
    with cp.client() as client:
        client.push(big, name="big")
    (v,) = cp.registry.store.list_versions("big")
    table = chunks.ChunkTable.from_manifest(
        v.variant("fp32").chunks["table"], v.variant("fp32").plaintext_size
    )
    names = {c.hex() for c in table.distinct()}
    assert names <= _referenced(cp) and v.variant("fp32").chunks["keys"]["ciphertext_sha256"] in (
        _referenced(cp)
    )
    for key in names:
        _backdate(cp.registry.blobs, key, 30 * DAY)
    orphan = _orphan(cp, b"a chunk of a push that failed", age_s=cp.registry.gc_grace_s + 60)
    with cp.client() as client:
        assert list(client.collect_garbage().blobs) == [orphan]
    assert all(cp.registry.blobs.exists(key) for key in names)
    lost = sorted(names)[0]
    cp.registry.blobs.delete(lost)  # as if a sweep's race had taken it
    with cp.client() as client:
        client.push(big, name="big", allow_duplicate=True)
    assert cp.registry.blobs.exists(lost)
