"""`skiff model push --pipeline`: the control plane checks the spec against the model."""

from __future__ import annotations

import json

import pytest

from control_plane.demo.sample_pipeline import activity_pipeline
from tests.control_plane.cli.test_cli import (  # noqa: F401 - fixtures
    _error_line,
    model_file,
    server,
    skiff,
)

EXIT_INVALID = 3


def versions(env, name: str) -> int:
    listed = json.loads(skiff("model", "ls", "--json", env=env).stdout)["models"]
    return next((m["version_count"] for m in listed if m["name"] == name), 0)


def test_a_pipeline_is_signed_into_the_manifest_and_shown(server, model_file, tmp_path):  # noqa: F811
    env = server["env"]
    spec = tmp_path / "pipeline.json"
    spec.write_text(json.dumps(activity_pipeline()))
    pushed = skiff(
        "model",
        "push",
        str(model_file),
        "--name",
        "scored",
        "--pipeline",
        str(spec),
        "--json",
        env=env,
    )
    body = json.loads(pushed.stdout)
    assert body["pipeline"]["triggers"][0]["name"] == "checkout"
    assert body["manifest"]["pipeline"] == body["pipeline"]
    # Defaults are spelled out in the signed form, so the device never guesses.
    assert body["pipeline"]["triggers"][0]["missing"] == 0.0
    shown = skiff("model", "show", "scored:1", env=env).stdout
    assert (
        "pipeline  events tap, scroll, purchase; triggers checkout (tap ~> purchase[amount > 0])"
        in shown
    )
    plain = skiff("model", "push", str(model_file), "--name", "scored", "--json", env=env)
    assert json.loads(plain.stdout)["pipeline"] is None


def _bad(**trigger) -> dict:
    doc = activity_pipeline()
    doc["triggers"][0].update(trigger)
    return doc


REFUSED = [
    ("unknown event type", _bad(pattern="tap ~> refund"), "unknown event type 'refund'"),
    ("bad pattern", _bad(pattern="tap ~>> purchase"), "expected an event type, found '>'"),
    ("wrong input", _bad(input="image"), "'image' is not the model's input 'x'"),
    (
        "too few features",
        _bad(features=[{"agg": "count", "window": {"count": 4}}]),
        "its features give 1 value(s) per firing; input 'x' takes 16",
    ),
    ("not a spec", {"triggers": "all"}, "missing ['event_types']"),
]


@pytest.mark.parametrize(("doc", "fragment"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_bad_pipeline_is_refused_with_the_reason_and_stores_nothing(
    server,  # noqa: F811
    model_file,  # noqa: F811
    tmp_path,
    doc,
    fragment,
):
    env = server["env"]
    before = versions(env, "refused")
    spec = tmp_path / "pipeline.json"
    spec.write_text(json.dumps(doc))
    result = skiff(
        "model",
        "push",
        str(model_file),
        "--name",
        "refused",
        "--pipeline",
        str(spec),
        env=env,
        check=False,
    )
    line = _error_line(result)
    assert result.returncode == EXIT_INVALID, result.stderr
    assert "pipeline" in line and fragment in line, line
    assert result.stdout == ""
    assert versions(env, "refused") == before


def test_an_unreadable_pipeline_file_is_named(server, model_file, tmp_path):  # noqa: F811
    env = server["env"]
    for path, text, fragment in [
        (tmp_path / "missing.json", None, "cannot read pipeline"),
        (tmp_path / "broken.json", '{"event_types": [', "is not JSON"),
        (tmp_path / "big.json", " " * (70 << 10), "over the 65536-byte limit"),
    ]:
        if text is not None:
            path.write_text(text)
        result = skiff(
            "model",
            "push",
            str(model_file),
            "--name",
            "x",
            "--pipeline",
            str(path),
            env=env,
            check=False,
        )
        assert fragment in _error_line(result) and str(path) in result.stderr
        assert result.returncode != 0
