"""`skiff model push` with golden inputs and accuracy gates, as a publisher runs it."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest

from control_plane.demo.third_party_models import by_name
from runtime.golden import Golden
from tests.control_plane.cli.test_cli import _error_line, server, skiff  # noqa: F401 - fixture

EXIT_INVALID = 3  # the CLI's exit code for a refused request (cli/main.py)


def test_degraded_int8_is_refused_in_one_line(server):  # noqa: F811
    model = by_name("ppocr-det")
    result = skiff(
        "model",
        "push",
        str(model.path),
        "--name",
        "det",
        "--variant",
        "int8",
        *model.shape_flags(),
        env=server["env"],
        check=False,
    )
    line = _error_line(result)
    assert result.returncode == EXIT_INVALID, result.stderr
    assert "int8 degraded: cosine 0." in line and "below 0.99" in line
    assert "--allow-degraded" in line
    assert result.stdout == ""


def test_allow_degraded_records_and_shows_it(server, tmp_path):  # noqa: F811
    model = by_name("ppocr-det")
    golden = tmp_path / "page.npz"
    buffer = io.BytesIO()
    np.savez(buffer, **model.golden_inputs())
    golden.write_bytes(buffer.getvalue())
    pushed = skiff(
        "model",
        "push",
        str(model.path),
        "--name",
        "det-kept",
        "--variant",
        "int8,fp16",
        "--golden",
        str(golden),
        "--allow-degraded",
        "--min-cosine",
        "0.995",
        "--json",
        env=server["env"],
    )
    body = json.loads(pushed.stdout)  # nothing but the JSON on stdout
    variants = {v["name"]: v for v in body["variants"]}
    assert variants["int8"]["degraded"] is True
    assert variants["int8"]["accuracy"]["min_cosine"] == 0.995
    assert variants["int8"]["accuracy"]["cosine"] < 0.995
    assert variants["fp16"]["degraded"] is False
    assert variants["fp32"]["accuracy"] is None
    assert body["golden"]["source"] == "publisher" and body["golden"]["plaintext_size"] > 0
    assert body["signature"]["outputs"] == [
        {"name": "sigmoid_0.tmp_0", "shape": [1, 1, 320, 320], "dtype": "float32"}
    ]
    assert body["signature"]["inputs"][0]["shape"] == [1, 3, -1, -1]
    shown = skiff("model", "show", "det-kept:1", env=server["env"]).stdout
    assert "sigmoid_0.tmp_0[1x1x320x320] float32" in shown
    assert "DEGRADED: cosine 0." in shown and "below 0.995" in shown
    assert "golden    the publisher's inputs" in shown
    int8_line = next(line for line in shown.splitlines() if line.strip().startswith("int8"))
    assert "vs fp32: cosine 0." in int8_line
    pulled = skiff(
        "model",
        "pull",
        "det-kept:1",
        "--golden",
        "-o",
        str(tmp_path / "g.npz"),
        "--json",
        env=server["env"],
    )
    assert json.loads(pulled.stdout)["variant"] == "golden"
    stored = Golden.from_npz((tmp_path / "g.npz").read_bytes())
    np.testing.assert_array_equal(stored.inputs["x"], model.golden_inputs()["x"])
    assert stored.outputs["sigmoid_0.tmp_0"].shape == (1, 1, 320, 320)


@pytest.mark.parametrize(
    ("flag", "words"),
    [
        (["--input-shape", "x"], "use NAME=D1,D2,..."),
        (["--input-shape", "x=1,3,a"], "dimensions must be integers"),
        (["--input-shape", "x=1,0"], "dimensions must be positive"),
        (["--input-range", "sr=1"], "use NAME=LOW:HIGH"),
        (["--input-range", "sr=2:1"], "need finite LOW <= HIGH"),
        (["--min-cosine", "2"], "a cosine similarity in (0, 1]"),
        (["--min-cosine", "nan"], "a cosine similarity in (0, 1]"),
    ],
)
def test_malformed_flags_are_usage_errors(server, flag, words):  # noqa: F811
    model = by_name("ppocr-cls")
    result = skiff(
        "model", "push", str(model.path), "--name", "cls", *flag, env=server["env"], check=False
    )
    assert result.returncode == 2
    assert words in result.stderr


def test_missing_golden_file_is_one_line(server, tmp_path):  # noqa: F811
    model = by_name("ppocr-cls")
    result = skiff(
        "model",
        "push",
        str(model.path),
        "--name",
        "cls",
        "--golden",
        str(tmp_path / "nope.npz"),
        env=server["env"],
        check=False,
    )
    line = _error_line(result)
    assert "cannot read golden inputs" in line and "nope.npz" in line
