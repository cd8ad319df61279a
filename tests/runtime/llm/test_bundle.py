"""Bundle tars are read without trusting them; bundles are validated; BundleDir loads."""

from __future__ import annotations

import fcntl
import gzip
import io
import json
import os
import stat
import tarfile

import pytest

from runtime.llm.bundle import (
    BundleDir,
    InvalidBundle,
    close_files,
    read_bundle_tar,
    validate_bundle,
    write_bundle_tar,
)
from tests.runtime.llm._helpers import bundle_files, memfds, tar_bytes, tar_with


def _member(name: str, kind: bytes, **attrs) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for key, value in attrs.items():
        setattr(info, key, value)
    return info


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _read(data: bytes, **kwargs):
    return read_bundle_tar(io.BytesIO(data), **kwargs)


def _refused(data: bytes, match: str, **kwargs) -> None:
    before = _open_fds()
    with pytest.raises(InvalidBundle, match=match):
        _read(data, **kwargs)
    assert _open_fds() == before  # every memfd made before the refusal was closed


# ---------------------------------------------------------------- reading


def test_a_bundle_tar_becomes_sealed_memfds_with_the_same_bytes():
    files = bundle_files()
    fds = _read(tar_bytes(files))
    try:
        assert set(fds) == set(files)
        for name, fd in fds.items():
            assert os.pread(fd, 1 << 20, 0) == files[name]
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            for seal in (fcntl.F_SEAL_WRITE, fcntl.F_SEAL_GROW, fcntl.F_SEAL_SHRINK):
                assert seals & seal
            with pytest.raises(PermissionError):
                os.pwrite(fd, b"x", 0)
    finally:
        close_files(fds)


def test_a_stream_of_chunks_reads_like_a_file():
    data = tar_bytes(bundle_files())
    chunks = (data[i : i + 7] for i in range(0, len(data), 7))
    fds = read_bundle_tar(chunks)
    try:
        assert os.pread(fds["llm.mnn"], 100, 0) == b"graph"
    finally:
        close_files(fds)


def test_a_leading_dot_slash_is_tolerated():
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.addfile(_member("./", tarfile.DIRTYPE))
        for name, blob in bundle_files().items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))
    fds = _read(out.getvalue())
    close_files(fds)
    assert "config.json" in fds


def test_absolute_paths_are_refused():
    _refused(tar_bytes({"/etc/config.json": b"{}"}), "'/etc/config.json' has an absolute path")


def test_dot_dot_paths_are_refused():
    _refused(tar_bytes({"../config.json": b"{}"}), r"'\.\./config.json' escapes the bundle")


def test_nested_files_are_refused():
    _refused(tar_bytes({"model/config.json": b"{}"}), "'model/config.json' is nested")


def test_directories_are_refused():
    _refused(tar_with(_member("sub", tarfile.DIRTYPE)), "'sub' is a directory")


def test_symlinks_are_refused():
    link = _member("llm.mnn", tarfile.SYMTYPE, linkname="/etc/passwd")
    _refused(tar_with(link, base={}), "'llm.mnn' is a symbolic link")


def test_hard_links_are_refused():
    link = _member("llm.mnn.weight", tarfile.LNKTYPE, linkname="llm.mnn")
    _refused(tar_with(link, base={"llm.mnn": b"x"}), "'llm.mnn.weight' is a hard link")


@pytest.mark.parametrize("kind", [tarfile.CHRTYPE, tarfile.BLKTYPE])
def test_device_files_are_refused(kind):
    device = _member("tokenizer.txt", kind, devmajor=1, devminor=3)
    _refused(tar_with(device, base={}), "'tokenizer.txt' is a device file")


def test_fifos_are_refused():
    _refused(tar_with(_member("llm.mnn", tarfile.FIFOTYPE), base={}), "FIFO")


def test_unknown_members_are_refused():
    _refused(tar_bytes({**bundle_files(), "visual.mnn": b"v"}), "unknown member 'visual.mnn'")
    _refused(tar_bytes({**bundle_files(), "visual.mnn": b"v"}), "text-only MNN-LLM bundles")
    _refused(tar_bytes({**bundle_files(), "notes.txt": b"v"}), "holds only config.json")


def test_duplicate_members_are_refused():
    _refused(tar_with(tarfile.TarInfo("llm.mnn"), b"evil"), "'llm.mnn' appears twice")


def test_oversize_members_are_refused_from_their_header():
    limits = {name: 1 << 20 for name in bundle_files()} | {"llm.mnn.weight": 4}
    _refused(
        tar_bytes(bundle_files()), "'llm.mnn.weight' is 7 bytes, over its 4-byte", limits=limits
    )


def test_truncated_tars_are_refused():
    data = tar_bytes({"llm.mnn.weight": b"w" * 5000})
    _refused(data[:2048], "truncated|not a readable")


def test_compressed_tars_are_refused():
    _refused(gzip.compress(tar_bytes(bundle_files())), "not a readable uncompressed tar")


def test_garbage_is_refused():
    _refused(b"\x01" * 1024, "not a readable uncompressed tar")


# ---------------------------------------------------------------- validation


def _validate(files: dict[str, bytes]):
    fds = memfds(files)
    try:
        return validate_bundle(fds)
    finally:
        close_files(fds)


def _config(**keys) -> bytes:
    return json.dumps({"llm_model": "llm.mnn", **keys}).encode()


def _llm_config(**keys) -> bytes:
    return json.dumps({"hidden_size": 8, "layer_nums": 2, **keys}).encode()


def test_a_valid_bundle_reports_what_it_is():
    info = _validate(bundle_files())
    assert info.tokenizer == "tokenizer.txt"
    assert not info.tied_embeddings
    assert info.chat_template == "{{ x }}"
    assert (info.hidden_size, info.layer_nums, info.context_length) == (8, 2, 2048)


@pytest.mark.parametrize(
    "name", ["config.json", "llm_config.json", "llm.mnn", "llm.mnn.weight", "tokenizer.txt"]
)
def test_each_required_file_is_required(name):
    with pytest.raises(InvalidBundle, match=rf"{name.replace('.', '[.]')} is missing"):
        _validate(bundle_files(**{name.replace(".", "__"): None}))


def test_embeddings_are_required_unless_tied():
    with pytest.raises(InvalidBundle, match="embeddings_bf16.bin is missing"):
        _validate(bundle_files(embeddings_bf16__bin=None))
    tied = _llm_config(tie_embeddings=[0, 64, 128, 4, 32])
    info = _validate(bundle_files(embeddings_bf16__bin=None, llm_config__json=tied))
    assert info.tied_embeddings


def test_the_config_may_name_the_mtok_tokenizer():
    files = bundle_files(tokenizer__txt=None, config__json=_config(tokenizer_file="tokenizer.mtok"))
    files["tokenizer.mtok"] = b"\x04binary"
    assert _validate(files).tokenizer == "tokenizer.mtok"


@pytest.mark.parametrize(
    "key, value",
    [
        ("llm_model", "/etc/passwd"),
        ("llm_model", "../llm.mnn"),
        ("llm_weight", "/proc/self/fd/3"),
        ("tokenizer_file", "/tmp/tokenizer.txt"),
        ("embedding_file", "llm.mnn"),
        ("llm_config", "config.json"),
    ],
)
def test_a_config_naming_a_file_outside_the_bundle_is_refused(key, value):
    with pytest.raises(InvalidBundle, match=f"key {key} names"):
        _validate(bundle_files(config__json=_config(**{key: value})))


@pytest.mark.parametrize("key", ["tmp_path", "prefix_cache_path", "lookup_file", "draft_model"])
def test_other_paths_are_refused(key):
    with pytest.raises(InvalidBundle, match=f"key {key} names '/tmp/x'"):
        _validate(bundle_files(llm_config__json=_llm_config(**{key: "/tmp/x"})))


def test_base_dir_is_refused():
    with pytest.raises(InvalidBundle, match="sets base_dir"):
        _validate(bundle_files(config__json=_config(base_dir="/")))


@pytest.mark.parametrize(
    "keys, what",
    [
        ({"is_visual": True}, "vision"),
        ({"visual_model": "visual.mnn"}, "a vision part"),
        ({"is_audio": True}, "audio"),
        ({"audio_model": "audio.mnn"}, "an audio part"),
        ({"has_talker": True}, "talker"),
        ({"mllm": {"backend_type": "cpu"}}, "multimodal"),
        ({"speculative_type": "mtp"}, "speculative"),
        ({"is_single": False}, "split"),
    ],
)
def test_non_text_parts_are_refused_by_name(keys, what):
    with pytest.raises(InvalidBundle, match=what):
        _validate(bundle_files(llm_config__json=_llm_config(**keys)))


@pytest.mark.parametrize(
    "blob, match",
    [
        (b"{", "not valid JSON"),
        (b"\xff{}", "not valid JSON"),
        (b"[]", "must hold a JSON object"),
        (b'{"hidden_size": NaN}', "NaN is not a number"),
        (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
        (b'{"a":' * 40 + b"1" + b"}" * 40, "nests deeper"),
        (b'{"a":' * 990 + b"1" + b"}" * 990, "nests deeper"),  # parses; not checked recursively
        (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),  # past what the parser follows
        (b'{"model_type": "\\ud800"}', "not UTF-8 text"),  # MNN crashed on a lone surrogate
        (b'{"\\udfff": 1}', "not UTF-8 text"),
        (b'{"hidden_size": 1e12}', "hidden_size=1000000000000.0 is not an integer"),
        (b'{"layer_nums": true}', "layer_nums=True is not an integer"),
        (b'{"max_all_tokens": -5}', "max_all_tokens=-5"),
        (b" " * (5 << 20), "over"),
    ],
)
def test_configs_are_parsed_with_bounds(blob, match):
    with pytest.raises(InvalidBundle, match=match):
        _validate(bundle_files(llm_config__json=blob))


def test_the_tokenizer_magic_is_checked():
    with pytest.raises(InvalidBundle, match="magic number 430"):
        _validate(bundle_files(tokenizer__txt=b"999 3\n"))


def test_two_tokenizers_are_refused():
    files = bundle_files()
    files["tokenizer.mtok"] = b"x"
    with pytest.raises(InvalidBundle, match="tokenizer.mtok is present but the config uses"):
        _validate(files)


def test_empty_graphs_are_refused():
    with pytest.raises(InvalidBundle, match="llm.mnn is empty"):
        _validate(bundle_files(llm__mnn=b""))


def test_a_bundle_without_a_template_says_so():
    assert _validate(bundle_files(llm_config__json=_llm_config())).chat_template is None
    # MNN 3.6.1 ignores the legacy keys: they do not make a template.
    legacy = _llm_config(prompt_template="<|user|>%s<|assistant|>")
    assert _validate(bundle_files(llm_config__json=legacy)).chat_template is None
    empty = _llm_config(jinja={"chat_template": "  ", "eos": "</s>"})
    assert _validate(bundle_files(llm_config__json=empty)).chat_template is None


def test_context_length_comes_from_max_all_tokens():
    info = _validate(bundle_files(config__json=_config(max_all_tokens=512)))
    assert info.context_length == 512


# ---------------------------------------------------------------- BundleDir


def test_bundle_dir_links_to_the_memfds_and_holds_only_the_config():
    files = bundle_files()
    fds = memfds(files)
    try:
        with BundleDir(fds, overrides={"thread_num": 2}) as bundle_dir:
            root = bundle_dir.path
            assert stat.S_IMODE(os.stat(root).st_mode) == 0o700
            for name, fd in fds.items():
                entry = root / name
                if name == "config.json":
                    assert not entry.is_symlink()
                    config = json.loads(entry.read_text())
                    assert config == {**json.loads(files[name]), "thread_num": 2}
                else:
                    assert os.readlink(entry) == f"/proc/self/fd/{fd}"
                    assert entry.read_bytes() == files[name]
            assert bundle_dir.config_path == str(root / "config.json")
        assert not root.exists()
    finally:
        close_files(fds)


# ---------------------------------------------------------------- writing


def _write_dir(path, files: dict[str, bytes], mtime: int) -> None:
    path.mkdir()
    for name, blob in files.items():
        (path / name).write_bytes(blob)
        os.utime(path / name, (mtime, mtime))


def test_the_canonical_tar_is_deterministic_sorted_and_reads_back(tmp_path):
    files = bundle_files()
    _write_dir(tmp_path / "a", files, 1_000_000)
    _write_dir(tmp_path / "b", dict(reversed(files.items())), 2_000_000)
    (tmp_path / "b" / "llm.mnn.json").write_text("{}")  # an exporter leftover: skipped
    os.chmod(tmp_path / "b" / "llm.mnn", 0o755)
    write_bundle_tar(tmp_path / "a", tmp_path / "a.tar")
    out = io.BytesIO()
    info = write_bundle_tar(tmp_path / "b", out)
    assert out.getvalue() == (tmp_path / "a.tar").read_bytes()
    assert info.chat_template == "{{ x }}"
    with tarfile.open(tmp_path / "a.tar") as tar:
        members = tar.getmembers()
    assert [m.name for m in members] == sorted(files)
    assert {(m.mtime, m.uid, m.gid, m.mode, m.uname) for m in members} == {(0, 0, 0, 0o644, "")}
    fds = read_bundle_tar(io.BytesIO(out.getvalue()))
    try:
        assert {n: os.pread(fd, 1 << 20, 0) for n, fd in fds.items()} == files
    finally:
        close_files(fds)


def test_writing_refuses_unknown_files_and_links(tmp_path):
    _write_dir(tmp_path / "a", {**bundle_files(), "visual.mnn": b"v"}, 0)
    with pytest.raises(InvalidBundle, match="unknown file visual.mnn"):
        write_bundle_tar(tmp_path / "a", tmp_path / "a.tar")
    _write_dir(tmp_path / "b", bundle_files(llm__mnn=None), 0)
    (tmp_path / "b" / "llm.mnn").symlink_to("/etc/passwd")
    with pytest.raises(InvalidBundle, match="llm.mnn is not a regular file"):
        write_bundle_tar(tmp_path / "b", tmp_path / "b.tar")


def test_writing_validates_first(tmp_path):
    _write_dir(tmp_path / "a", bundle_files(llm__mnn__weight=None), 0)
    with pytest.raises(InvalidBundle, match="llm.mnn.weight is missing"):
        write_bundle_tar(tmp_path / "a", tmp_path / "a.tar")
    assert not (tmp_path / "a.tar").exists()
