"""Updates that move only what changed: a real control plane, real agents, chunked versions.

A model of a few MB (a sized MLP, converted by MNN) is pushed, installed, changed in one
tensor and pushed again: the agent fetches only the chunks it does not hold. Then the
attacks: a device asking for chunks and keys of a version it is not assigned, a chunk
flipped or swapped in the blob store, a chunk damaged on the device's disk.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import os
import threading
import time

import grpc
import onnx
import pytest
from onnx import numpy_helper

from contract import chunks
from contract.device_client import DeviceCallError
from control_plane.demo import sample_models
from control_plane.registry import chunking
from control_plane.views.fleet_text import rollout_text
from device_agent import chunk_store, install
from device_agent.chunk_store import ChunkStore, OpenedChunks
from device_agent.download import IntegrityFailure
from protos import fleet_pb2
from tests.control_plane.api.device_helpers import Device
from tests.device_agent.conftest import blob_path
from tests.device_agent.test_agent import once, token
from tests.device_agent.test_faults import crash_run

BIG = "big"
SIZE = 3 << 20  # about 12 chunks at the default average


def _onnx(seed: int = 1) -> bytes:
    return sample_models.sized_mlp_onnx(SIZE, seed=seed)


def _mnn(onnx_model: bytes) -> bytes:
    """Converted here once: MNN stamps every conversion with a fresh uuid (one chunk)."""
    return sample_models.onnx_to_mnn_bytes(onnx_model)


def _one_tensor_changed(model: bytes) -> bytes:
    """The same network with its last weight matrix re-trained (scaled): one tensor moves."""
    graph = onnx.load_from_string(model)
    last = graph.graph.initializer[-1]
    array = numpy_helper.to_array(last)
    last.CopyFrom(numpy_helper.from_array((array * 1.01).astype(array.dtype), last.name))
    return graph.SerializeToString()


def _push(cp, tmp_path, data: bytes, name: str = BIG, **kw):
    path = tmp_path / f"{name}-{len(list(tmp_path.glob('*.mnn')))}.mnn"
    path.write_bytes(data)
    with cp.client() as client:
        return client.push(path, name=name, **kw)


def _rollout(cp, version: int, name: str = BIG, selector: str = "") -> None:
    with cp.client() as client:
        client.create_rollout(
            fleet_pb2.CreateRolloutRequest(
                model=name, version=version, selector=selector, allow_empty=True
            )
        )


def _table(cp, version: int, name: str = BIG) -> chunks.ChunkTable:
    _, [v] = cp.registry.show(name, version)
    fp32 = v.variant("fp32")
    return chunks.ChunkTable.from_manifest(fp32.chunks["table"], fp32.plaintext_size)


def _install(cp, state, version: int, **kw):
    _rollout(cp, version)
    outcome = asyncio.run(once(cp, state, **kw))
    (result,) = [o for o in outcome.installs if o.model == BIG]
    assert result.result == "activated", result.reason
    return result


def test_a_new_version_fetches_only_the_chunks_it_does_not_hold(cp, tmp_path):
    state = tmp_path / "state"
    source = _onnx()
    v1 = _mnn(source)
    assert _push(cp, tmp_path, v1).version == 1
    table1 = _table(cp, 1)
    assert len(table1.distinct()) >= 6
    first = _install(cp, state, 1, enroll_token=token(cp))
    full = sum(c.ciphertext_size for c in table1.distinct().values())
    assert first.timings.downloaded_bytes == full
    assert (first.timings.chunks_fetched, first.timings.chunks_held) == (
        len(table1.distinct()),
        0,
    )
    # One tensor changed: the chunks around it move, the rest are held already.
    assert _push(cp, tmp_path, _mnn(_one_tensor_changed(source))).version == 2
    table2 = _table(cp, 2)
    new = [c for c in table2.distinct().values() if c.id not in table1.distinct()]
    second = _install(cp, state, 2)
    assert second.timings.downloaded_bytes == sum(c.ciphertext_size for c in new)
    assert second.timings.chunks_held >= len(table2.distinct()) // 2
    assert second.timings.downloaded_bytes < full / 2
    # The first version's bytes again: every chunk is held (v1's are kept as previous).
    assert _push(cp, tmp_path, v1, allow_duplicate=True).version == 3
    third = _install(cp, state, 3)
    assert (third.timings.downloaded_bytes, third.timings.chunks_fetched) == (0, 0)
    # The store keeps what the kept versions (active v3, previous v2) need, nothing else.
    held = {p.name for p in (state / "chunks").iterdir()}
    kept = {c.hex() for c in (*table1.distinct(), *table2.distinct())}
    assert held == kept
    assert not list((state / "artifacts").glob("*.part"))


def test_chunks_are_stored_once_per_model_and_never_shared_across_models(cp, tmp_path):
    v1 = _mnn(_onnx(seed=2))
    _push(cp, tmp_path, v1)
    _push(cp, tmp_path, v1, allow_duplicate=True)
    _push(cp, tmp_path, v1, name="twin")
    one, two, twin = _table(cp, 1), _table(cp, 2), _table(cp, 1, "twin")
    assert one.chunks == two.chunks  # the same plaintext in one model: the same chunks
    assert not set(one.distinct()) & set(twin.distinct())  # another model: nothing alike
    # Each chunk is one blob, whatever the number of versions naming it.
    for ref in one.distinct().values():
        assert blob_path(cp, ref.id.hex()).stat().st_size == ref.ciphertext_size


def _device_on_v1(cp, tmp_path):
    """A device assigned big:1 only (big:2 pushed, rolled out to nobody), and big:1/2."""
    source = _onnx(seed=3)
    _push(cp, tmp_path, _mnn(source))
    _push(cp, tmp_path, _mnn(_one_tensor_changed(source)))
    _rollout(cp, 1, selector="region=one")
    device = Device.enroll(cp.address, token(cp), {"region": "one"})
    verified = device.sync()
    return device, verified.models[BIG]


def test_a_device_gets_the_chunks_and_keys_of_its_assignment_and_nothing_else(cp, tmp_path):
    device, m = _device_on_v1(cp, tmp_path)
    assert m.version == 1 and m.chunks is not None and m.chunk_keys is not None
    one, two = _table(cp, 1), _table(cp, 2)
    only_two = [c for c in two.distinct().values() if c.id not in one.distinct()]
    shared = [c for c in two.distinct().values() if c.id in one.distinct()]
    assert only_two and shared
    # Its own chunks and key list: served, and they open with the keys it was sent.
    key = device.keys.unwrap(m.wrapped_data_key, device_id=device.id, version_uid=m.uid)
    from contract.envelope import decrypt_stream

    packed_ct = device.download(m.chunk_keys.ciphertext_sha256, m.chunk_keys.ciphertext_size)
    packed = b"".join(
        decrypt_stream(key, [packed_ct], associated_data=m.chunk_keys.associated_data)
    )
    keys = chunks.unpack_keys(packed, m.chunks)
    plain = b"".join(
        chunks.open_chunk(keys[c.id], BIG, c.id, device.download(c.id.hex(), c.ciphertext_size))
        for c in m.chunks.chunks
    )
    assert len(plain) == m.plaintext_size
    # A chunk v2 shares with v1 is v1's too: served (the device holds its key already).
    assert device.download(shared[0].id.hex(), shared[0].ciphertext_size)
    # A chunk only v2 has, and v2's key list: refused, naming nothing.
    _, [v2] = cp.registry.show(BIG, 2)
    v2_keys = v2.variant("fp32").chunks["keys"]
    for blob, size in (
        (only_two[0].id.hex(), only_two[0].ciphertext_size),
        (v2_keys["ciphertext_sha256"], v2_keys["ciphertext_size"]),
    ):
        with pytest.raises(DeviceCallError) as refused:
            device.download(blob, size)
        assert refused.value.code == grpc.StatusCode.PERMISSION_DENIED
        assert "not assigned" in refused.value.message
    # Even holding v2's bytes (say, from a leaked blob store), v1's keys open none of them.
    stolen = blob_path(cp, only_two[0].id.hex()).read_bytes()
    for k in keys.values():
        with pytest.raises(Exception, match="failed authentication"):
            chunks.open_chunk(k, BIG, only_two[0].id, stolen)


def test_a_flipped_or_swapped_chunk_fails_the_install_and_the_next_sync_repairs_it(cp, tmp_path):
    state = tmp_path / "state"
    asyncio.run(once(cp, state, enroll_token=token(cp)))  # enrolled, nothing assigned yet
    _push(cp, tmp_path, _mnn(_onnx(seed=4)))
    table = _table(cp, 1)
    victim = table.chunks[2]
    blob = blob_path(cp, victim.id.hex())
    good = blob.read_bytes()
    flipped = bytearray(good)
    flipped[len(flipped) // 2] ^= 1
    # Another model's chunk of the very same length (its own key, its own model).
    swapped = chunks.seal_chunk(bytes(chunks.KEY_SIZE), "other", bytes(victim.size))
    _rollout(cp, 1)
    for bad in (bytes(flipped), swapped):
        assert len(bad) == len(good)
        blob.write_bytes(bad)
        (result,) = asyncio.run(once(cp, state)).installs
        assert result.result == "failed"
        assert "does not match its signed digest" in result.reason
        held = {p.name for p in (state / "chunks").iterdir()}
        assert victim.id.hex() not in held
        # Chunks that verified are kept: not fetched again.
        assert held <= {c.hex() for c in table.distinct()}
    blob.write_bytes(good)
    (result,) = asyncio.run(once(cp, state)).installs
    assert result.result == "activated", result.reason
    assert result.timings.chunks_fetched == len(table.distinct()) - len(held)


def test_a_chunk_damaged_on_the_device_is_refused_deleted_and_fetched_again(cp, tmp_path):
    state = tmp_path / "state"
    source = _onnx(seed=6)
    _push(cp, tmp_path, _mnn(source))
    _install(cp, state, 1, enroll_token=token(cp))
    _push(cp, tmp_path, _mnn(_one_tensor_changed(source)))
    ref = _table(cp, 1).chunks[1]
    assert ref.id in _table(cp, 2).distinct()  # v2 shares it: held, so not fetched
    on_disk = state / "chunks" / ref.id.hex()
    data = bytearray(on_disk.read_bytes())
    data[-1] ^= 1
    on_disk.write_bytes(bytes(data))
    _rollout(cp, 2)
    (result,) = asyncio.run(once(cp, state)).installs
    assert result.result == "failed"
    assert "damaged on the disk" in result.reason, result.reason
    assert not on_disk.exists()
    (result,) = asyncio.run(once(cp, state)).installs
    assert result.result == "activated", result.reason
    assert on_disk.exists()


def test_a_small_model_keeps_the_one_artifact_format(cp, tmp_path):
    pushed = _push(cp, tmp_path, _mnn(sample_models.tiny_mlp_onnx(seed=9)), name="small")
    _, [v] = cp.registry.show("small", pushed.version)
    assert v.variant("fp32").chunks == {}
    assert chunking.CHUNKED_MIN_BYTES > v.variant("fp32").plaintext_size


def test_a_chunk_lost_from_the_blob_store_fails_only_its_model_and_a_push_puts_it_back(
    cp, tmp_path
):
    """A chunk the store lost (a sweep's race, an operator, a lifecycle rule): the install
    of that version fails on its own, the sync goes on with the other models, and the next
    push of the same bytes stores the chunk again instead of trusting the database."""
    state = tmp_path / "state"
    v1 = _mnn(_onnx(seed=7))
    _push(cp, tmp_path, v1)
    lost = _table(cp, 1).chunks[3]
    blob_path(cp, lost.id.hex()).unlink()
    _rollout(cp, 1)
    _rollout(cp, 1, name="det")  # the template's small model, in the same sync
    outcome = asyncio.run(once(cp, state, enroll_token=token(cp)))
    results = {o.model: o for o in outcome.installs}
    assert results["det"].result == "activated"
    assert results[BIG].result == "failed"
    assert f"chunk {lost.id.hex()[:12]} could not be fetched" in results[BIG].reason
    assert "NOT_FOUND" in results[BIG].reason
    _push(cp, tmp_path, v1, allow_duplicate=True)
    assert blob_path(cp, lost.id.hex()).stat().st_size == lost.ciphertext_size
    _rollout(cp, 2)
    (result,) = [o for o in asyncio.run(once(cp, state)).installs if o.model == BIG]
    assert result.result == "activated", result.reason


def test_the_chunk_store_reads_and_sweeps_regular_files_only(tmp_path):
    store = ChunkStore(tmp_path / "chunks")
    data = chunks.seal_chunk(bytes(chunks.KEY_SIZE), BIG, b"x" * 100)
    cid = chunks.chunk_id(data)
    # Planted: a directory named like a chunk, a .part linked to a file outside the store.
    (tmp_path / "chunks").mkdir()
    (tmp_path / "chunks" / ("ab" * 32)).mkdir()
    precious = tmp_path / "precious"
    precious.write_bytes(b"precious")
    (tmp_path / "chunks" / f"{cid.hex()}.part").symlink_to(precious)
    assert store.held() == set()  # a directory is no chunk
    store.put(cid, data)
    assert precious.read_bytes() == b"precious"  # the link was replaced, not written through
    assert store.held() == {cid} and store.read(cid) == data
    assert store.sweep({cid}) == 1  # the planted directory
    assert sorted(p.name for p in (tmp_path / "chunks").iterdir()) == [cid.hex()]
    with pytest.raises(IntegrityFailure, match="does not match its signed digest"):
        store.put(bytes(32), data)


def test_a_power_cut_while_a_chunk_is_written_loses_nothing_kept(cp, tmp_path):
    """SIGKILL half-way through writing the fifth chunk: the chunks kept by then (about
    four: chunks are kept in threads, a few at once) are whole, the cut one is not taken
    for a chunk, and the next run fetches only the rest."""
    state = tmp_path / "state"
    _push(cp, tmp_path, _mnn(_onnx(seed=12)))
    table = _table(cp, 1)
    _rollout(cp, 1)
    crash_run(cp, state, "chunk:5", "--enroll-token", token(cp))
    held = {p.name for p in (state / "chunks").iterdir() if not p.name.endswith(".part")}
    assert len(held) < 4 + chunk_store.WRITERS and held <= {c.hex() for c in table.distinct()}
    store = ChunkStore(state / "chunks")
    for name in held:
        store.read(bytes.fromhex(name))  # whole: it matches its id
    (result,) = asyncio.run(once(cp, state)).installs
    assert result.result == "activated", result.reason
    assert result.timings.chunks_held == len(held)
    assert result.timings.chunks_fetched == len(table.distinct()) - len(held)
    assert not list((state / "chunks").glob("*.part"))


def test_a_chunk_store_that_fills_the_disk_fails_the_install_cleanly(cp, tmp_path, monkeypatch):
    state = tmp_path / "state"
    _push(cp, tmp_path, _mnn(_onnx(seed=13)))
    table = _table(cp, 1)
    _rollout(cp, 1)
    real, writes = chunk_store.write_all, [0]

    def filling(fd: int, data: bytes) -> None:
        writes[0] += 1
        if writes[0] > 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    monkeypatch.setattr(chunk_store, "write_all", filling)
    (result,) = asyncio.run(once(cp, state, enroll_token=token(cp))).installs
    assert result.result == "failed" and "disk full while storing chunk" in result.reason
    assert not list((state / "chunks").glob("*.part"))  # no half chunk holds the space
    assert len(list((state / "chunks").iterdir())) == 3  # the whole ones stay for the retry
    monkeypatch.setattr(chunk_store, "write_all", real)
    (result,) = asyncio.run(once(cp, state)).installs
    assert result.result == "activated", result.reason
    assert result.timings.chunks_fetched == len(table.distinct()) - 3


def test_a_sweep_racing_an_install_keeps_the_chunks_it_fetched(cp, tmp_path, monkeypatch):
    """A sweep that says nothing is assigned any more (the harshest), run after every chunk
    an install stores (in the threads that write them, behind the download and during the
    self-test): the install's chunks stay, and it activates."""
    state = tmp_path / "state"
    _push(cp, tmp_path, _mnn(_onnx(seed=14)))
    _rollout(cp, 1)
    installers, real_install, real_store = [], install.Installer.install, ChunkStore._store

    async def recording(self, conn, m):
        installers.append(self)
        return await real_install(self, conn, m)

    def store_then_sweep(self, chunk_id, ciphertext, **kw):
        real_store(self, chunk_id, ciphertext, **kw)
        installers[-1].collect_garbage(set())

    monkeypatch.setattr(install.Installer, "install", recording)
    monkeypatch.setattr(ChunkStore, "_store", store_then_sweep)
    (result,) = asyncio.run(once(cp, state, enroll_token=token(cp))).installs
    assert result.result == "activated", result.reason
    assert result.timings.chunks_fetched == len(_table(cp, 1).distinct())


def test_chunks_in_another_order_or_one_twice_do_not_make_the_signed_plaintext(tmp_path):
    """The table is signed; were it not, chunks out of order, or a chunk listed twice in
    place of another, still could not pass: the whole plaintext's signed digest fails,
    whether the chunks are read from the store or were opened as they were fetched."""
    from device_agent.plaintext import from_chunks

    plain = hashlib.shake_256(b"order").digest(2 << 20)
    sealed = list(chunking.seal(chunks.new_secret(), BIG, plain, avg=64 << 10))
    assert len(sealed) >= 4
    store = ChunkStore(tmp_path / "chunks")
    for s in sealed:
        store.put(s.ref.id, s.ciphertext)
    keys = {s.ref.id: s.key for s in sealed}
    digest = hashlib.sha256(plain).hexdigest()
    good = chunks.ChunkTable(tuple(s.ref for s in sealed))
    assert from_chunks(store, good, keys, BIG, digest, len(plain)).read() == plain
    swapped = list(good.chunks)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    doubled = [*good.chunks[:-1], good.chunks[0]]
    for refs in (swapped, doubled):
        table = chunks.ChunkTable(tuple(refs))
        for opened in (None, _opened(sealed, keys)):
            with pytest.raises(IntegrityFailure, match="plaintext does not match its digest|long"):
                from_chunks(store, table, keys, BIG, digest, len(plain), opened).read()
    opened = _opened(sealed, keys)
    assert from_chunks(store, good, keys, BIG, digest, len(plain), opened).read() == plain
    assert all(opened.take(s.ref.id, last=True) is None for s in sealed)  # handed on, dropped


def _opened(sealed, keys) -> OpenedChunks:
    opened = OpenedChunks(keys, BIG)
    for s in sealed:
        opened.open(s.ref.id, s.ciphertext)
    return opened


def test_a_chunk_is_opened_as_it_arrives_only_if_it_matches_its_id_and_key():
    """Nothing of a chunk is kept in memory unless it matches its signed id and then
    authenticates under its own key and model."""
    plain = hashlib.shake_256(b"opened").digest(1 << 20)
    sealed = list(chunking.seal(chunks.new_secret(), BIG, plain, avg=64 << 10))
    keys = {s.ref.id: s.key for s in sealed}
    first, second = sealed[0], sealed[1]
    flipped = bytearray(first.ciphertext)
    flipped[len(flipped) // 2] ^= 1
    cases = [
        (OpenedChunks(keys, BIG), bytes(flipped), "does not match its signed digest"),
        (OpenedChunks(keys, BIG), first.ciphertext + b"\0", "does not match its signed digest"),
        (OpenedChunks(keys, BIG), first.ciphertext[:-1], "does not match its signed digest"),
        (OpenedChunks({**keys, first.ref.id: second.key}, BIG), first.ciphertext, "failed auth"),
        (OpenedChunks(keys, "other"), first.ciphertext, "failed authentication"),
        (OpenedChunks({}, BIG), first.ciphertext, "has no key"),
    ]
    for opened, ciphertext, reason in cases:
        with pytest.raises(IntegrityFailure, match=reason):
            opened.open(first.ref.id, ciphertext)
        assert opened.take(first.ref.id, last=True) is None


def test_a_chunk_served_longer_or_shorter_than_signed_installs_nothing(cp, tmp_path):
    """One byte more or one less than the chunk's table says (the control plane refuses
    to serve it), or a byte changed (the device refuses it): the install fails, nothing of
    that chunk is kept, and no version is active."""
    state = tmp_path / "state"
    asyncio.run(once(cp, state, enroll_token=token(cp)))  # enrolled, nothing assigned yet
    _push(cp, tmp_path, _mnn(_onnx(seed=16)))
    victim = _table(cp, 1).chunks[3]
    blob = blob_path(cp, victim.id.hex())
    good = blob.read_bytes()
    _rollout(cp, 1)
    flipped = bytes([good[0] ^ 1]) + good[1:]
    for bad, reason in (
        (good + b"\0", "is longer than"),
        (good[:-1], f"ended at {len(good) - 1} of {len(good)} bytes"),
        (flipped, "signed digest"),
    ):
        blob.write_bytes(bad)
        (result,) = asyncio.run(once(cp, state)).installs
        assert result.result == "failed" and reason in result.reason, result.reason
        assert victim.id.hex() not in {p.name for p in (state / "chunks").iterdir()}
        assert not json.loads((state / "models" / f"{BIG}.json").read_text()).get("active")
    blob.write_bytes(good)
    (result,) = asyncio.run(once(cp, state)).installs
    assert result.result == "activated", result.reason


def test_an_install_opens_the_chunks_it_fetches_as_they_arrive(cp, tmp_path, monkeypatch):
    """The self-test reads back from the store only the chunks held before the download."""
    state = tmp_path / "state"
    source = _onnx(seed=17)
    _push(cp, tmp_path, _mnn(source))
    _push(cp, tmp_path, _mnn(_one_tensor_changed(source)))
    reads, real_read = [], ChunkStore.read

    def reading(self, chunk_id):
        reads.append(chunk_id)
        return real_read(self, chunk_id)

    monkeypatch.setattr(ChunkStore, "read", reading)
    _install(cp, state, 1, enroll_token=token(cp))
    assert reads == []
    second = _install(cp, state, 2)
    held = set(_table(cp, 1).distinct())
    assert set(reads) == held & set(_table(cp, 2).distinct()) and second.timings.chunks_held


def test_rollout_show_says_what_a_device_downloads_from_each_earlier_version(cp, tmp_path):
    source = _onnx(seed=15)
    _push(cp, tmp_path, _mnn(source))
    _push(cp, tmp_path, _mnn(_one_tensor_changed(source)))
    one, two = _table(cp, 1), _table(cp, 2)
    full = sum(c.ciphertext_size for c in two.distinct().values())
    delta = sum(c.ciphertext_size for c in two.distinct().values() if c.id not in one.distinct())
    assert 0 < delta < full / 2
    with cp.client() as client:
        created = client.create_rollout(
            fleet_pb2.CreateRolloutRequest(model=BIG, version=2, allow_empty=True)
        )
        shown = client.get_rollout(created.id)
    assert shown.download_bytes == full
    assert dict(shown.download_bytes_from) == {1: delta}
    text = rollout_text(shown)
    assert f"download  {full / 1e6:.2f} MB per device; from v1 {delta / 1e6:.2f} MB" in text


def test_chunks_waiting_for_a_slow_disk_hold_the_download_back_not_memory(tmp_path):
    """A disk slower than the network: at no time are more than WRITE_BACKLOG chunks
    downloaded and not yet written (each holds its room from before its download)."""
    plain = hashlib.shake_256(b"slow disk").digest(8 << 20)
    sealed = list(chunking.seal(chunks.new_secret(), BIG, plain, avg=64 << 10))
    assert len(sealed) > 3 * chunk_store.WRITE_BACKLOG
    assert chunk_store.CHUNKS_PER_CALL <= chunk_store.WRITE_BACKLOG  # a call's rooms fit
    served = {s.ref.id.hex(): s.ciphertext for s in sealed}
    count = {"downloaded": 0, "written": 0, "most_held": 0}
    lock = threading.Lock()

    class Network:
        async def download_chunks(self, artifacts):
            for name, _ in artifacts:
                with lock:
                    count["downloaded"] += 1
                    held = count["downloaded"] - count["written"]
                    count["most_held"] = max(count["most_held"], held)
                yield name, served[name]
                await asyncio.sleep(0)

    store = ChunkStore(tmp_path / "chunks")
    write = store._store

    def slow_write(chunk_id, ciphertext, **kw):
        time.sleep(0.002)  # a slow card: the network always wins
        write(chunk_id, ciphertext, **kw)
        with lock:
            count["written"] += 1

    store._store = slow_write
    table = chunks.ChunkTable(tuple(s.ref for s in sealed))

    async def fetch():
        writes = await store.fetch_missing(Network(), table)
        await writes.kept()

    # Bounded: calls that each took part of the rooms they need would wait on each other.
    asyncio.run(asyncio.wait_for(fetch(), 60))
    assert count["written"] == len(table.distinct())
    assert count["most_held"] <= chunk_store.WRITE_BACKLOG
    assert store.held() >= set(table.distinct())
