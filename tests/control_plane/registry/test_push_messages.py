"""What `skiff model push` says: per-variant verdicts, failed bars, flags, duplicates."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest

from contract import errors
from control_plane.cli.golden_flags import push_options
from control_plane.cli.main import build_parser
from control_plane.cli.push_views import push_text, variant_summary
from control_plane.cli.views import version_text
from control_plane.demo import sample_models
from control_plane.demo.third_party_models import by_name
from control_plane.registry import accuracy_bars
from control_plane.registry.golden import AccuracyBar, GoldenRequest, refuse_degraded
from control_plane.registry.requests import PushRequest
from protos import admin_pb2, admin_pb2_grpc, common_pb2
from runtime.golden import Tolerance
from tests.control_plane.cli.test_cli import _error_line, skiff
from tests.control_plane.helpers import start_control_plane

EXIT_INVALID, EXIT_CONFLICT = 3, 7  # cli/main.py

# Cosine fine, relative error not: the case the old label called "below 0.99".
RELATIVE_ONLY = {
    "cosine": 0.9996,
    "relative_error": 0.31,
    "max_abs_error": 2.5,
    "min_cosine": 0.99,
    "outputs": [
        {"name": "boxes", "cosine": 0.9999, "relative_error": 0.01, "max_abs_error": 0.1},
        {"name": "scores", "cosine": 0.9996, "relative_error": 0.31, "max_abs_error": 2.5},
    ],
}
COSINE_ONLY = {
    "cosine": 0.42,
    "relative_error": 0.05,
    "max_abs_error": 0.2,
    "min_cosine": 0.99,
    "outputs": [{"name": "y", "cosine": 0.42, "relative_error": 0.05, "max_abs_error": 0.2}],
}
PASSING = {
    "cosine": 0.9999,
    "relative_error": 0.004,
    "max_abs_error": 0.01,
    "min_cosine": 0.99,
    "outputs": [{"name": "y", "cosine": 0.9999, "relative_error": 0.004, "max_abs_error": 0.01}],
}


def _variant(name: str, figures: dict, degraded: bool) -> common_pb2.Variant:
    outputs = [common_pb2.OutputAccuracy(**o) for o in figures["outputs"]]
    accuracy = common_pb2.VariantAccuracy(
        **{k: v for k, v in figures.items() if k != "outputs"}, outputs=outputs
    )
    return common_pb2.Variant(name=name, degraded=degraded, accuracy=accuracy)


@pytest.mark.parametrize(
    ("figures", "failed", "passed"),
    [
        (
            RELATIVE_ONLY,
            "relative error 0.31 above 0.141 on output 'scores'",
            "cosine 0.9996 >= 0.99",
        ),
        (COSINE_ONLY, "cosine 0.4200 below 0.99", "relative error 0.05 <= 0.141"),
    ],
    ids=["relative-error", "cosine"],
)
def test_the_degraded_label_names_the_bar_that_failed(figures, failed, passed):
    """`model show`, the push summary, its refusal and --json all name the failed bar."""
    variant = _variant("int8", figures, degraded=True)
    assert [bar.text() for bar in accuracy_bars.failed_bars(figures)] == [failed]
    # model show
    version = common_pb2.ModelVersion(model="det", version=2, variants=[variant])
    shown = version_text(version)
    assert f"DEGRADED: {failed}" in shown and "below the accuracy" not in shown
    # push summary, with the bar that passed beside it
    assert variant_summary(variant) == (
        f"int8 degraded: {failed} ({passed}); stored because of --allow-degraded (a rollout "
        "takes it only with --allow-degraded)"
    )
    # the refusal, and --json
    bar = AccuracyBar(figures, degraded=True, self_test=Tolerance(), variant="int8")
    with pytest.raises(errors.InvalidModel) as refused:
        refuse_degraded({"int8": bar}, GoldenRequest())
    assert str(refused.value).startswith(f"int8 degraded: {failed} ({passed}); nothing stored")
    (as_json,) = accuracy_bars.variant_status(True, figures)["failed_bars"]
    assert as_json["bar"] == ("cosine" if "cosine" in failed.split()[0] else "relative_error")
    assert as_json["passed"] is False


def test_a_refusal_gives_every_variants_verdict_in_one_line():
    bars = {
        "fp16": AccuracyBar(PASSING, degraded=False, self_test=Tolerance(), variant="fp16"),
        "int8": AccuracyBar(RELATIVE_ONLY, degraded=True, self_test=Tolerance(), variant="int8"),
        "int4": AccuracyBar(COSINE_ONLY, degraded=True, self_test=Tolerance(), variant="int4"),
    }
    with pytest.raises(errors.InvalidModel) as refused:
        refuse_degraded(bars, GoldenRequest())
    message = str(refused.value)
    assert "\n" not in message
    assert message.index("int8 degraded: relative error 0.31") < message.index(
        "int4 degraded: cosine 0.4200 below 0.99"
    )
    assert "fp16 passed: cosine 0.9999 >= 0.99, relative error 0.004 <= 0.141" in message
    assert message.endswith("keep int8 and int4 marked degraded, or drop them from --variant")
    refuse_degraded(bars, GoldenRequest(allow_degraded=True))  # kept, marked: no error


def test_the_push_summary_has_one_line_per_variant():
    version = common_pb2.ModelVersion(
        model="det",
        version=3,
        variants=[
            common_pb2.Variant(name="fp32"),
            _variant("fp16", PASSING, degraded=False),
            _variant("int8", RELATIVE_ONLY, degraded=True),
        ],
    )
    lines = push_text(version).splitlines()
    assert lines[0] == "pushed det:3"
    assert lines[1] == "  fp32 kept (the reference: the model as pushed)"
    assert lines[2] == "  fp16 kept: cosine 0.9999 >= 0.99, relative error 0.004 <= 0.141"
    assert lines[3].startswith("  int8 degraded: relative error 0.31 above 0.141")
    assert len(lines) == 4


@pytest.mark.parametrize(
    "argv",
    [
        ["--variant", "int8", "m.onnx", "--name", "x"],  # the old nargs="+" ate m.onnx
        ["m.onnx", "--name", "x", "--variant", "int8"],
    ],
    ids=["flag-first", "file-first"],
)
def test_variant_never_swallows_the_file_name(argv):
    args = build_parser().parse_args(["model", "push", *argv])
    assert str(args.file) == "m.onnx" and push_options(args)["variants"] == ("int8",)


def test_variant_takes_comma_lists_and_repeats():
    argv = ["model", "push", "m.onnx", "--name", "x", "--variant", "int8,fp16", "--variant", "int4"]
    args = build_parser().parse_args(argv)
    assert push_options(args)["variants"] == ("int8", "fp16", "int4")


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ("int9", "unknown variant 'int9': --variant derives fp16, int8, int4"),
        ("fp32", "fp32 is always kept"),
        ("int8,", "a comma list of variants"),
    ],
)
def test_a_bad_variant_is_a_usage_error(value, words, capsys):
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["model", "push", "m.onnx", "--name", "x", "--variant", value])
    assert exited.value.code == 2
    assert words in capsys.readouterr().err


# -- through a server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    plane = start_control_plane(tmp_path_factory.mktemp("push") / "home")
    plane.env = {"SKIFF_HOME": str(plane.config.home), "SKIFF_SERVER": plane.address}
    plane.env["SKIFF_TOKEN"] = ""
    yield plane
    plane.stop()


def _model(tmp_path, seed: int):
    path = tmp_path / f"m{seed}.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=seed))
    return path


def _versions(cp, name: str) -> int:
    try:
        return len(cp.registry.store.list_versions(name))
    except errors.NotFound:
        return 0


def _orphans(cp) -> set[str]:
    return set(cp.registry.blobs.keys()) - cp.registry.store.referenced_blobs()


def test_the_same_bytes_again_are_refused_unless_allowed(cp, tmp_path):
    model = str(_model(tmp_path, seed=11))
    first = skiff("model", "push", "--variant", "int8", model, "--name", "dup", env=cp.env)
    assert first.stdout.splitlines()[0] == "pushed dup:1"
    again = skiff(
        "model", "push", model, "--name", "dup", "--variant", "int8", env=cp.env, check=False
    )
    assert again.returncode == EXIT_CONFLICT, again.stderr
    line = _error_line(again)
    assert "same bytes and variants as dup:1" in line and "--allow-duplicate" in line
    assert again.stdout == "" and _versions(cp, "dup") == 1
    allowed = skiff(
        "model",
        "push",
        model,
        "--name",
        "dup",
        "--variant",
        "int8",
        "--allow-duplicate",
        env=cp.env,
    )
    assert allowed.stdout.splitlines()[0] == "pushed dup:2"
    # Other variants make another version: nothing to refuse.
    other = skiff("model", "push", model, "--name", "dup", "--variant", "fp16", env=cp.env)
    assert other.stdout.splitlines()[0] == "pushed dup:3"
    assert _orphans(cp) == set()


def test_a_declared_duplicate_is_refused_before_its_upload(cp, tmp_path):
    path = _model(tmp_path, seed=12)
    with cp.client() as client:
        client.push(path, name="early")
    data = path.read_bytes()
    header = admin_pb2.PushHeader(
        name="early", filename=path.name, size=len(data), sha256=hashlib.sha256(data).hexdigest()
    )
    # The header alone: a server that waited for the bytes would say the upload is short.
    with cp.channel() as channel, pytest.raises(grpc.RpcError) as refused:
        admin_pb2_grpc.AdminServiceStub(channel).PushModel(
            iter([admin_pb2.PushModelRequest(header=header)]),
            metadata=(("authorization", f"Bearer {cp.token}"),),
        )
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "early:1" in refused.value.details()


def test_a_duplicate_committed_while_a_push_ran_is_refused_at_commit(cp, tmp_path, monkeypatch):
    """Two pushes of the same bytes checked before either committed: the second is refused."""
    path = _model(tmp_path, seed=13)
    data = path.read_bytes()
    with cp.client() as client:
        client.push(path, name="race")
    store, stale = cp.registry.store, [2]
    real_get_version = store.get_version

    def checked_before_the_other_committed(name, number=None):
        if name == "race" and number is None and stale[0]:
            stale[0] -= 1  # the checks before the MNN work and before the insert
            raise errors.NotFound("no versions yet")
        return real_get_version(name, number)

    monkeypatch.setattr(store, "get_version", checked_before_the_other_committed)
    real_create, raised = cp.registry._create_version, []

    def create_version(*args, **kwargs):
        try:
            return real_create(*args, **kwargs)
        except Exception as exc:
            raised.append(type(exc).__name__)
            raise

    monkeypatch.setattr(cp.registry, "_create_version", create_version)
    request = PushRequest(name="race", actor="admin", filename=path.name)
    with pytest.raises(errors.FailedPrecondition, match="same bytes and variants as race:1"):
        cp.registry.push(request, [data])
    # Both checks saw no version; the insert saw version 1 committed and checked again.
    assert stale == [0] and raised == ["_LatestMoved"]
    assert _versions(cp, "race") == 1 and _orphans(cp) == set()


def test_push_says_each_variants_verdict_and_json_gives_its_status(cp, tmp_path):
    """At --min-cosine 1 no quantised variant is exact: int8 is degraded, kept or refused."""
    model = str(_model(tmp_path, seed=14))
    bar = ("--variant", "int8,fp16", "--min-cosine", "1")
    refused = skiff("model", "push", model, "--name", "strict", *bar, env=cp.env, check=False)
    assert refused.returncode == EXIT_INVALID, refused.stderr
    line = _error_line(refused)
    assert "int8 degraded: " in line and "relative error" in line and "above 0;" in line
    assert "nothing stored: pass --allow-degraded" in line and _versions(cp, "strict") == 0

    pushed = skiff(
        "model", "push", model, "--name", "strict", *bar, "--allow-degraded", env=cp.env
    ).stdout.splitlines()
    shown = json.loads(skiff("model", "show", "strict:1", "--json", env=cp.env).stdout)
    variants = {v["name"]: v for v in shown["versions"][0]["variants"]}
    assert pushed[0] == "pushed strict:1"
    lines = {text.split()[0]: text for text in pushed[1:]}
    assert set(lines) == set(variants) == {"fp32", "int8", "fp16"}
    for name, variant in variants.items():
        assert lines[name].startswith(f"  {name} {variant['status']}")
        for failed in variant["failed_bars"]:
            assert failed["bar"].replace("_", " ") in lines[name] and failed["passed"] is False
    assert variants["fp32"]["status"] == "kept" and variants["fp32"]["failed_bars"] == []
    assert variants["int8"]["status"] == "degraded"
    assert "stored because of --allow-degraded" in lines["int8"]
    text = skiff("model", "show", "strict:1", env=cp.env).stdout
    assert "DEGRADED: " in text and "DEGRADED (below" not in text


def test_every_missing_shape_and_range_is_named_at_once(cp):
    """Silero VAD has two dynamic inputs and an integer one: one push says all three."""
    model = by_name("silero-vad")
    result = skiff("model", "push", str(model.path), "--name", "vad", env=cp.env, check=False)
    assert result.returncode == EXIT_INVALID, result.stderr
    line = _error_line(result)
    for flag in ("--input-shape input=", "--input-shape state=2,N,128", "--input-range sr="):
        assert flag in line, line
    assert "--golden" in line and not line.endswith("...")
    flags = [*model.shape_flags(), "--input-range", "sr=16000:16000"]
    pushed = skiff("model", "push", str(model.path), "--name", "vad", *flags, env=cp.env)
    assert pushed.stdout.splitlines()[0] == "pushed vad:1"
