"""A language model's bundle on the device: decrypted straight into memfds, or refused whole.

The happy path runs in test_llm_generate.py (a real agent); here, each way the artifact
can be wrong, and that no descriptor is left open when it is.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from contract import chunks
from contract.envelope import encrypt_chunks, new_data_key
from control_plane.registry import chunking
from device_agent.chunk_store import ChunkStore
from device_agent.download import IntegrityFailure
from device_agent.llm_install import _decrypt_bundle
from device_agent.plaintext import from_artifact, from_chunks
from device_agent.state import SelfTestFailed
from tests.runtime.llm._helpers import bundle_files, tar_bytes

AD = b"skiff:uid:q4"


def _artifact(tmp_path: Path, plain: bytes, key: bytes) -> Path:
    path = tmp_path / "artifact"
    path.write_bytes(b"".join(encrypt_chunks(key, iter((plain,)), associated_data=AD)))
    return path


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_good_bundle_lands_in_sealed_memfds(tmp_path):
    key, plain = new_data_key(), tar_bytes(bundle_files())
    path = _artifact(tmp_path, plain, key)
    files = _decrypt_bundle(
        from_artifact(path, key, AD, hashlib.sha256(plain).hexdigest(), len(plain))
    )
    try:
        assert set(files) == set(bundle_files())
        for name, fd in files.items():
            assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
            assert os.pread(fd, 1 << 20, 0) == bundle_files()[name]
    finally:
        for fd in files.values():
            os.close(fd)


@pytest.mark.parametrize("how", ["digest", "size", "flipped", "key"])
def test_a_wrong_artifact_is_an_integrity_failure_and_leaves_nothing_open(tmp_path, how):
    key, plain = new_data_key(), tar_bytes(bundle_files())
    path = _artifact(tmp_path, plain, key)
    digest, size = hashlib.sha256(plain).hexdigest(), len(plain)
    if how == "digest":
        digest = hashlib.sha256(b"other").hexdigest()
    elif how == "size":
        size -= 1
    elif how == "flipped":
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 1
        path.write_bytes(bytes(data))
    else:
        key = new_data_key()
    before = _open_fds()
    with pytest.raises(IntegrityFailure):
        _decrypt_bundle(from_artifact(path, key, AD, digest, size))
    assert _open_fds() == before


def test_a_tar_that_is_not_a_bundle_fails_the_self_test(tmp_path):
    key = new_data_key()
    plain = tar_bytes({**bundle_files(), "../etc/passwd": b"x"})
    path = _artifact(tmp_path, plain, key)
    before = _open_fds()
    with pytest.raises(SelfTestFailed, match="self-test failed"):
        _decrypt_bundle(from_artifact(path, key, AD, hashlib.sha256(plain).hexdigest(), len(plain)))
    assert _open_fds() == before


def test_a_bundle_from_chunks_lands_whole_or_not_at_all(tmp_path):
    """A chunked bundle: the same memfds from the chunk store, and a chunk damaged there
    fails the bundle without leaving a descriptor open."""
    plain = tar_bytes(bundle_files())
    store = ChunkStore(tmp_path / "chunks")
    secret = chunks.new_secret()
    sealed = list(chunking.seal(secret, "chat", plain, avg=64 << 10))
    for s in sealed:
        store.put(s.ref.id, s.ciphertext)
    table = chunks.ChunkTable(tuple(s.ref for s in sealed))
    keys = {s.ref.id: s.key for s in sealed}
    digest = hashlib.sha256(plain).hexdigest()
    files = _decrypt_bundle(from_chunks(store, table, keys, "chat", digest, len(plain)))
    try:
        assert {n: os.pread(fd, 1 << 20, 0) for n, fd in files.items()} == bundle_files()
    finally:
        for fd in files.values():
            os.close(fd)
    victim = store.path(sealed[-1].ref.id)
    victim.write_bytes(victim.read_bytes()[:-1] + b"\0")
    before = _open_fds()
    with pytest.raises(IntegrityFailure, match="damaged on the disk"):
        _decrypt_bundle(from_chunks(store, table, keys, "chat", digest, len(plain)))
    assert _open_fds() == before
    assert not victim.exists()  # refetched by the next install
