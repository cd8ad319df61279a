"""MNN tooling against the real engine, each call in a real child process."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnx.reference
import pytest
from onnx import TensorProto, helper, numpy_helper

from contract import errors
from control_plane.demo import sample_models
from control_plane.registry import mnn_tools
from control_plane.registry.mnn_tools import ModelSignature, TensorSpec
from tests.ci import on_ci

MNN_VERSION = importlib.metadata.version("MNN")
REPO_ROOT = Path(__file__).resolve().parents[3]
TINY_SIGNATURE = ModelSignature(
    inputs=(TensorSpec("x", (1, 16), "float32"),),
    outputs=(TensorSpec("y", (1, 4), "float32"),),
    mnn_version=MNN_VERSION,
)


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("test-model", os.MFD_CLOEXEC)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _read(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


@pytest.fixture
def memfd():
    opened: list[int] = []

    def make(data: bytes) -> int:
        opened.append(_memfd(data))
        return opened[-1]

    yield make
    for fd in opened:
        os.close(fd)


def _onnx(nodes, initializers=(), x_shape=(1, 4), y_shape=(1, 4)) -> bytes:
    graph = helper.make_graph(
        nodes,
        "test",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x_shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(y_shape))],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@pytest.fixture(scope="module")
def tiny_mnn() -> bytes:
    return sample_models.onnx_to_mnn_bytes(sample_models.tiny_mlp_onnx())


@pytest.fixture(scope="module")
def medium_mnn() -> bytes:
    # 512-wide layers: big enough that quantisation visibly shrinks the file, and a multiple
    # of the int4 block size so block-wise quantisation really applies.
    return sample_models.onnx_to_mnn_bytes(sample_models.sized_mlp_onnx(4_200_000))


@pytest.fixture(scope="module")
def variants(medium_mnn) -> dict[str, bytes]:
    src = _memfd(medium_mnn)
    try:
        made = {}
        for name in mnn_tools.VARIANTS:
            fd = mnn_tools.make_variant(src, name)
            made[name] = _read(fd)
            os.close(fd)
        return made
    finally:
        os.close(src)


# --- sample models -----------------------------------------------------------------------


def test_tiny_mlp_is_a_valid_runnable_onnx_model():
    model = onnx.load_from_string(sample_models.tiny_mlp_onnx())
    onnx.checker.check_model(model, full_check=True)
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add", "Relu", "MatMul", "Add"]
    (y,) = onnx.reference.ReferenceEvaluator(model).run(None, {"x": np.ones((1, 16), np.float32)})
    assert y.shape == (1, 4) and np.isfinite(y).all()


def test_sized_mlp_hits_its_target_and_streams_the_same_bytes(memfd):
    data = sample_models.sized_mlp_onnx(3_000_000, seed=5)
    assert abs(len(data) - 3_000_000) < 300_000
    onnx.checker.check_model(onnx.load_from_string(data))
    fd = memfd(b"")
    assert sample_models.write_sized_mlp_onnx(fd, 3_000_000, seed=5) == len(data)
    assert _read(fd) == data
    assert sample_models.sized_mlp_onnx(3_000_000, seed=6) != data


# --- happy paths -------------------------------------------------------------------------


def test_onnx_converts_and_inspects_without_touching_the_callers_fd(memfd):
    src = memfd(sample_models.tiny_mlp_onnx())
    os.lseek(src, 7, os.SEEK_SET)
    assert mnn_tools.sniff_format(src) == "onnx"
    dst = mnn_tools.convert_onnx(src)
    try:
        assert os.lseek(src, 0, os.SEEK_CUR) == 7
        assert mnn_tools.sniff_format(dst) == "mnn"
        assert mnn_tools.inspect_model(dst) == TINY_SIGNATURE
        assert os.lseek(dst, 0, os.SEEK_CUR) == 0
    finally:
        os.close(dst)


def test_signature_round_trips_through_json(memfd, tiny_mnn):
    signature = mnn_tools.inspect_model(memfd(tiny_mnn))
    assert signature.mnn_version == MNN_VERSION
    restored = ModelSignature.from_dict(json.loads(json.dumps(signature.to_dict())))
    assert restored == signature


def test_dynamic_dims_are_reported_and_the_forward_pass_skipped(memfd):
    relu = _onnx([helper.make_node("Relu", ["x"], ["y"])], x_shape=("B", "L"), y_shape=("B", "L"))
    mnn = sample_models.onnx_to_mnn_bytes(relu)
    signature = mnn_tools.inspect_model(memfd(mnn))
    # MNN's converter pins an unknown batch dimension to 1; other unknown dims stay -1.
    assert signature.inputs == (TensorSpec("x", (1, -1), "float32"),)
    assert signature.outputs == (TensorSpec("y", (), "unknown"),)


def test_every_variant_loads_and_quantised_ones_are_smaller(memfd, medium_mnn, variants):
    base = mnn_tools.inspect_model(memfd(medium_mnn))
    assert base.inputs == (TensorSpec("x", (1, 512), "float32"),)
    for name, data in variants.items():
        assert mnn_tools.inspect_model(memfd(data)) == base, name
    assert len(variants["fp16"]) < 0.55 * len(medium_mnn)
    assert len(variants["int8"]) < 0.30 * len(medium_mnn)
    assert len(variants["int4"]) < 0.70 * len(variants["int8"])


def test_variant_names_and_flags_agree():
    assert mnn_tools.VARIANTS == tuple(mnn_tools.VARIANT_FLAGS)


def test_onnx_sniffing_knows_every_model_proto_field():
    fields = {
        f.number: 0 if f.type == f.TYPE_INT64 else 2 for f in onnx.ModelProto.DESCRIPTOR.fields
    }
    assert mnn_tools._ONNX_MODEL_FIELDS == fields


# --- rejections --------------------------------------------------------------------------


def test_unknown_variant_is_an_invalid_argument(memfd, tiny_mnn):
    with pytest.raises(errors.InvalidArgument, match="unknown variant 'int2'") as caught:
        mnn_tools.make_variant(memfd(tiny_mnn), "int2")
    assert type(caught.value) is errors.InvalidArgument


@pytest.mark.parametrize(
    "call",
    [
        mnn_tools.sniff_format,
        mnn_tools.inspect_model,
        mnn_tools.convert_onnx,
        lambda fd: mnn_tools.make_variant(fd, "int8"),
    ],
)
def test_empty_file_is_an_invalid_argument(memfd, call):
    with pytest.raises(errors.InvalidArgument, match="^model file is empty$") as caught:
        call(memfd(b""))
    assert type(caught.value) is errors.InvalidArgument


def test_sniffing_rejects_garbage_and_truncated_onnx(memfd, tiny_mnn):
    for data in (os.urandom(4096), b"\x00" * 64, sample_models.tiny_mlp_onnx()[:-100]):
        with pytest.raises(errors.InvalidModel, match="^unrecognised model format"):
            mnn_tools.sniff_format(memfd(data))
    # A truncated .mnn keeps its header, so it sniffs as MNN; loading it is what fails.
    assert mnn_tools.sniff_format(memfd(tiny_mnn[: len(tiny_mnn) // 2])) == "mnn"


@pytest.mark.parametrize("kind", ["random", "truncated", "onnx"])
def test_inspect_rejects_what_mnn_cannot_load(memfd, tiny_mnn, kind):
    data = {
        "random": os.urandom(5000),
        "truncated": tiny_mnn[: len(tiny_mnn) // 2],
        "onnx": sample_models.tiny_mlp_onnx(),
    }[kind]
    with pytest.raises(errors.InvalidModel) as caught:
        mnn_tools.inspect_model(memfd(data))
    message = str(caught.value)
    assert message.startswith("not a valid MNN model: MNN refused to load it (")
    assert "\n" not in message


def test_inspect_rejects_a_model_that_loads_but_cannot_run(memfd):
    weight = numpy_helper.from_array(np.ones((7, 4), np.float32), "w")
    mismatched = _onnx([helper.make_node("MatMul", ["x", "w"], ["y"])], [weight])
    mnn = sample_models.onnx_to_mnn_bytes(mismatched)  # MNN converts it regardless
    with pytest.raises(errors.InvalidModel, match="^not a valid MNN model: forward pass on zeros"):
        mnn_tools.inspect_model(memfd(mnn))


def test_convert_reports_the_unsupported_op(memfd):
    src = memfd(sample_models.unconvertible_onnx())
    assert mnn_tools.sniff_format(src) == "onnx"
    with pytest.raises(errors.InvalidModel) as caught:
        mnn_tools.convert_onnx(src)
    assert str(caught.value) == (
        "ONNX model could not be converted: These Op Not Support: ONNX::SkiffNoSuchOp"
    )


@pytest.mark.parametrize(
    "data",
    [os.urandom(3000), sample_models.tiny_mlp_onnx()[:2000]],
    ids=["random", "truncated"],  # fixed: xdist workers must collect the same ids
)
def test_convert_rejects_corrupt_protobuf(memfd, data):
    with pytest.raises(errors.InvalidModel, match="^ONNX model could not be converted: not a read"):
        mnn_tools.convert_onnx(memfd(data))


def test_converter_segfault_is_contained(memfd):
    # MNN 3.6's converter dereferences null on a node input nothing produces.
    dangling = _onnx([helper.make_node("Add", ["x", "nowhere"], ["y"])])
    with pytest.raises(errors.InvalidModel) as caught:
        mnn_tools.convert_onnx(memfd(dangling))
    assert re.match(
        r"^ONNX model could not be converted: MNN crashed \(SIGSEGV\)", str(caught.value)
    )
    # This process is unharmed and the next conversion works.
    fd = mnn_tools.convert_onnx(memfd(sample_models.tiny_mlp_onnx()))
    os.close(fd)


def test_make_variant_verifies_its_input_first(memfd):
    # Without the check MNN's converter segfaults on a malformed .mnn.
    with pytest.raises(errors.InvalidModel) as caught:
        mnn_tools.make_variant(memfd(os.urandom(5000)), "int8")
    assert str(caught.value).startswith("int8 variant could not be made: not a valid MNN model (")


def test_onnx_external_data_cannot_read_host_files(memfd, tmp_path):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"TOP-SECRET-HOST-FILE-CONTENT-64-BYTES-LONG-ABCDEFGHIJKLMNOPQRST")
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 4])
    weight.data_location = TensorProto.EXTERNAL
    # MNN resolves the location against the model's directory, /proc/self/fd.
    location = os.path.relpath(secret, "/proc/self/fd")
    for key, value in {"location": location, "offset": "0", "length": "64"}.items():
        weight.external_data.add(key=key, value=value)
    model = _onnx([helper.make_node("MatMul", ["x", "w"], ["y"])], [weight])
    with pytest.raises(errors.InvalidModel, match="external data are not supported"):
        mnn_tools.convert_onnx(memfd(model))


def test_timeout_kills_the_worker(memfd, tiny_mnn):
    with pytest.raises(errors.InvalidModel, match="^not a valid MNN model: MNN took longer than"):
        mnn_tools.inspect_model(memfd(tiny_mnn), timeout=0.01)


def test_crash_outcome_names_the_signal_and_last_words():
    with pytest.raises(errors.InvalidModel) as caught:
        mnn_tools._outcome(-11, "", "starting\nlast words\n\n", "p")
    assert str(caught.value) == (
        "p: MNN crashed (SIGSEGV), as models needing more than its 8.0 GiB memory limit"
        " (mnn_memory_limit_bytes) do; last output: last words"
    )


# --- isolation ---------------------------------------------------------------------------


def test_worker_uses_the_native_converter_and_loads_no_phone_home_module(memfd, tiny_mnn):
    src, dst, model = memfd(sample_models.tiny_mlp_onnx()), memfd(b""), memfd(tiny_mnn)
    argv = ["--src-fd", str(src), "--dst-fd", str(dst)]
    converted = mnn_tools.run_worker("convert", argv, (src, dst), 60, "p")
    inspected = mnn_tools.run_worker("inspect", ["--model-fd", str(model)], (model,), 60, "p")
    assert "_tools" in converted["native_modules"]
    assert "MNN" in inspected["native_modules"]
    for payload in (converted, inspected):
        assert payload["forbidden_modules"] == []
        assert not any(m.startswith("MNN.tools") for m in payload["native_modules"])


def test_import_guard_blocks_the_phone_home_modules():
    script = textwrap.dedent(
        """
        import sys
        from runtime.mnn_host import forbidden_loaded, install_import_guard
        install_import_guard()
        import MNN
        for name in ("MNN.tools", "MNN.tools.utils.log", "aliyun.log"):
            try:
                __import__(name)
            except ImportError as exc:
                print("blocked", name, exc)
        print("loaded", forbidden_loaded())
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    ).stdout
    blocked = [line.split()[1] for line in out.splitlines() if line.startswith("blocked ")]
    assert blocked == ["MNN.tools", "MNN.tools.utils.log", "aliyun.log"]
    assert "loaded []" in out


_PIPELINE = """
import json, os, sys, tempfile
tempfile.tempdir = os.environ["TMPDIR"]  # skip tempfile's probe file: it would muddy strace
from control_plane.registry import mnn_tools
from control_plane.demo import sample_models
src = os.memfd_create("src")
sample_models.write_sized_mlp_onnx(src, 2_000_000)
dst = mnn_tools.convert_onnx(src)
mnn_tools.inspect_model(dst)
for name in mnn_tools.VARIANTS:
    mnn_tools.inspect_model(mnn_tools.make_variant(dst, name))
print(json.dumps(sorted(sys.modules)))
"""


def _run_pipeline(tmp_path, prefix=()):
    cwd, tmpdir = tmp_path / "cwd", tmp_path / "tmp"
    cwd.mkdir()
    tmpdir.mkdir()
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(REPO_ROOT)}
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # .pyc writes would muddy strace
    proc = subprocess.run(
        [*prefix, sys.executable, "-c", _PIPELINE],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return cwd, tmpdir, json.loads(proc.stdout.splitlines()[-1])


def test_parent_never_imports_mnn_and_leaves_no_files(tmp_path):
    cwd, tmpdir, modules = _run_pipeline(tmp_path)
    assert not {"MNN", "_mnncengine", "_tools"} & set(modules)
    assert list(cwd.iterdir()) == []
    assert list(tmpdir.iterdir()) == []


def _unable(reason: str) -> None:
    # `make test` installs strace; on CI a missing tool must fail, not quietly skip.
    (pytest.fail if on_ci() else pytest.skip)(reason)


@pytest.mark.slow
def test_no_file_is_opened_for_writing_except_memfds(tmp_path):
    if shutil.which("strace") is None:
        _unable("needs strace (make test installs it)")
    trace = tmp_path / "trace.log"
    calls = "trace=open,openat,openat2,creat"
    try:
        _run_pipeline(tmp_path, ["strace", "-f", "-qq", "-y", "-e", calls, "-o", str(trace)])
    except subprocess.CalledProcessError as exc:
        if "PTRACE" in exc.stderr or "Operation not permitted" in exc.stderr:
            _unable("ptrace is not permitted here")
        raise
    writes = [
        line
        for line in trace.read_text().splitlines()
        if re.search(r"O_(WRONLY|RDWR|CREAT)", line) and "= -1 " not in line
    ]
    targets = [re.search(r"= \d+<([^>]*)>", line).group(1) for line in writes]
    assert targets, "strace saw no writes at all; the check would prove nothing"
    assert [t for t in targets if not t.startswith(("/memfd:", "/dev/null"))] == []
    # The converter's own scratch file resolves to a memfd too, through the worker's symlink.
    assert any("skiff-mnn-spill" in t for t in targets)
