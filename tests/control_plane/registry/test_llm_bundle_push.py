"""`skiff model push DIR|FILE.tar`: a published MNN-LLM bundle becomes a version as it is.

A bundle is what MNN's exporter writes. Here it is one this registry converted from a
tiny GGUF and an operator pulled (the canonical tar of the same files), pushed back under
another name as a directory and as a tar: checked in the confined child without trusting
it, measured, answered on the golden prompts by itself (its own reference), and stored
encrypted like any artifact. Every malformed bundle is refused with a line naming the
part, and nothing is stored.
"""

from __future__ import annotations

import io
import json
import tarfile

import pytest

from tests.control_plane.cli.test_cli import _error_line, skiff
from tests.control_plane.registry.test_llm_push import EXIT_INVALID, _orphans, _versions, cp, tiny  # noqa: F401

pytestmark = pytest.mark.xdist_group("llm-push")


@pytest.fixture(scope="module")
def bundle(cp, tiny, tmp_path_factory):  # noqa: F811
    """The q8 bundle of the tiny GGUF, as a tar and as a directory."""
    skiff("model", "push", str(tiny), "--name", "tiny-src", "--variant", "q8", env=cp.env)
    folder = tmp_path_factory.mktemp("bundle")
    tar_path = folder / "tiny-q8.tar"
    skiff("model", "pull", "tiny-src:1", "--variant", "q8", "-o", str(tar_path), env=cp.env)
    directory = folder / "tiny-q8"
    directory.mkdir()
    with tarfile.open(tar_path) as tar:
        tar.extractall(directory, filter="data")
    (directory / "llm.mnn.json").write_text("{}")  # an exporter leftover: skipped
    return tar_path, directory


def test_a_bundle_directory_is_pushed_as_one_gated_variant(cp, bundle):  # noqa: F811
    _, directory = bundle
    pushed = skiff(
        "model",
        "push",
        str(directory),
        "--name",
        "tiny-bundle",
        "--variant",
        "q8",
        "--json",
        env=cp.env,
    )
    version = json.loads(pushed.stdout)
    assert version["source_format"] == "mnn-llm"
    (variant,) = version["variants"]
    assert variant["name"] == "q8" and variant["status"] == "kept"
    accuracy = variant["accuracy"]  # against itself: teacher-forced on its own answers
    assert accuracy["top1_agreement"] >= 0.99 and accuracy["positions"] > 0
    llm = variant["signature"]["llm"]
    assert llm["architecture"] == "llama" and llm["layers"] == 2 and llm["chat_template"]
    assert llm["memory_mb"] > llm["disk_mb"] > 0
    manifest = json.loads(cp.registry.store.get_version("tiny-bundle", 1).manifest)
    assert manifest["variants"]["q8"]["requirements"]["mnn"] == "3.6"
    _, golden = cp.registry.golden("tiny-bundle", 1)
    data = json.loads(golden)
    assert data["reference"] == "the bundle itself"
    assert all(p["reference"] and p["ids"] for p in data["prompts"])
    # The artifact is the canonical tar: the same bytes as the bundle it came from.
    src = cp.registry.store.get_version("tiny-src", 1).variant("q8")
    assert cp.registry.store.get_version("tiny-bundle", 1).variant("q8").plaintext_sha256 == (
        src.plaintext_sha256
    )


def test_the_same_bundle_as_a_tar_is_a_duplicate_unless_allowed(cp, bundle):  # noqa: F811
    tar_path, _ = bundle
    args = ("model", "push", str(tar_path), "--name", "tiny-bundle", "--variant", "q8")
    again = skiff(*args, env=cp.env, check=False)
    assert again.returncode == 7 and "same bytes and variants" in _error_line(again)
    skiff(*args, "--allow-duplicate", env=cp.env)
    assert _versions(cp, "tiny-bundle") == 2


def _tar(path, members: dict, *, extra=()) -> None:
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info)


def _members(tar_path) -> dict:
    with tarfile.open(tar_path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers()}


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ("dotdot", "member '../llm.mnn' escapes the bundle"),
        ("absolute", "member '/etc/llm.mnn' has an absolute path"),
        ("symlink", "is a symbolic link, not a regular file"),
        ("device", "not a regular file"),
        ("missing", "llm.mnn is missing"),
        ("outside", "llm_config.json"),
        ("vision", "a vision, audio or other model part"),
        ("visual_flag", "vision"),
    ],
)
def test_a_malformed_bundle_tar_is_refused_naming_the_part(cp, bundle, tmp_path, change, fragment):  # noqa: F811
    tar_path, _ = bundle
    members = _members(tar_path)
    extra = []
    if change == "dotdot":
        members["../llm.mnn"] = members.pop("llm.mnn")
    elif change == "absolute":
        members["/etc/llm.mnn"] = members.pop("llm.mnn")
    elif change == "symlink":
        link = tarfile.TarInfo("tokenizer.mtok")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        extra.append(link)
    elif change == "device":
        dev = tarfile.TarInfo("embeddings_bf16.bin")
        dev.type = tarfile.CHRTYPE
        extra.append(dev)
    elif change == "missing":
        del members["llm.mnn"]
    elif change == "outside":
        config = json.loads(members["llm_config.json"])
        config["llm_model"] = "../../etc/passwd"
        members["llm_config.json"] = json.dumps(config).encode()
    elif change == "vision":
        members["visual.mnn"] = b"\0" * 64
    elif change == "visual_flag":
        config = json.loads(members["llm_config.json"])
        config["is_visual"] = True
        members["llm_config.json"] = json.dumps(config).encode()
    bad = tmp_path / "bad.tar"
    _tar(bad, members, extra=extra)
    before, orphans = _versions(cp, "tiny-bad"), _orphans(cp)
    refused = skiff("model", "push", str(bad), "--name", "tiny-bad", env=cp.env, check=False)
    assert refused.returncode == EXIT_INVALID and fragment in _error_line(refused), refused.stderr
    assert refused.stdout == ""
    assert _versions(cp, "tiny-bad") == before and _orphans(cp) == orphans


def test_a_bundle_directory_with_a_vision_part_is_refused_before_uploading(cp, bundle, tmp_path):  # noqa: F811
    _, directory = bundle
    (directory / "visual.mnn").write_bytes(b"\0" * 64)
    try:
        refused = skiff(
            "model", "push", str(directory), "--name", "tiny-vl", env=cp.env, check=False
        )
    finally:
        (directory / "visual.mnn").unlink()
    assert refused.returncode == EXIT_INVALID
    line = _error_line(refused)
    assert "unknown file visual.mnn" in line and "text-only MNN-LLM bundles" in line
    assert _versions(cp, "tiny-vl") == 0


def test_a_bundle_is_one_variant(cp, bundle):  # noqa: F811
    tar_path, _ = bundle
    two = skiff(
        "model",
        "push",
        str(tar_path),
        "--name",
        "tiny-two",
        "--variant",
        "q4,q8",
        env=cp.env,
        check=False,
    )
    assert two.returncode == EXIT_INVALID and "one variant" in _error_line(two)
    tensor = skiff(
        "model",
        "push",
        str(tar_path),
        "--name",
        "tiny-two",
        "--variant",
        "int8",
        env=cp.env,
        check=False,
    )
    assert tensor.returncode == EXIT_INVALID
    assert "does not apply to an MNN-LLM bundle" in _error_line(tensor)


def test_a_model_type_that_is_not_a_plain_name_is_shown_as_unknown(cp, bundle, tmp_path):  # noqa: F811
    """Whatever a bundle's config says reaches operators' terminals: never raw escapes."""
    tar_path, _ = bundle
    members = _members(tar_path)
    config = json.loads(members["llm_config.json"])
    config["model_type"] = "\x1b]0;PWNED\x07\x1b[2J\nfake line: q8 kept" + "x" * 200_000
    members["llm_config.json"] = json.dumps(config).encode()
    path = tmp_path / "escapes.tar"
    _tar(path, members)
    pushed = json.loads(
        skiff(
            "model",
            "push",
            str(path),
            "--name",
            "tiny-esc",
            "--variant",
            "q8",
            "--json",
            env=cp.env,
        ).stdout
    )
    assert pushed["variants"][0]["signature"]["llm"]["architecture"] == "unknown"
    shown = skiff("model", "show", "tiny-esc:1", env=cp.env).stdout
    assert "\x1b" not in shown and "PWNED" not in shown
