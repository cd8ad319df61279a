"""Hostile uploads: models that try to read the server's keys or exhaust its memory.

Real server on port 0, real MNN children, real keyset in the home. The MNN child must be
confined (empty environment, another user, limits, seccomp) and such pushes must fail
with a clear error, store nothing, and never echo the key material anywhere.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from contract import errors
from control_plane.registry import mnn_flatbuffer, mnn_tools
from control_plane.registry.mnn_sandbox import Sandbox
from tests.control_plane.helpers import start_control_plane

WIDTH = 16  # floats in the model's one weight: 64 bytes of whatever file it points at


@pytest.fixture
def cp(tmp_path):
    plane = start_control_plane(tmp_path / "home", mnn_memory_limit_bytes=512 << 20)
    yield plane
    plane.stop()


def _keyset(cp) -> bytes:
    data = open(cp.config.kek, "rb").read()
    assert len(data) >= 4 * WIDTH
    return data


def _onnx(nodes, initializers, width: int = WIDTH) -> bytes:
    graph = helper.make_graph(
        nodes,
        "hostile",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, width])],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


def _external_weight_onnx(location: str) -> bytes:
    """y = x + w, where w is 64 bytes of ONNX external data read from `location`."""
    weight = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[1, WIDTH])
    weight.data_location = TensorProto.EXTERNAL
    for key, value in {"location": location, "offset": "0", "length": str(4 * WIDTH)}.items():
        weight.external_data.add(key=key, value=value)
    return _onnx([helper.make_node("Add", ["x", "w"], ["y"])], [weight])


_MAKE_MNN_WITH_EXTERNAL_PATH = """
import json, sys
import _tools  # MNN's native converter
onnx_path, path = sys.argv[1:3]
_tools.mnnconvert(["mnnconvert", "-f", "ONNX", "--modelFile", onnx_path, "--MNNModel", "a.mnn",
                   "--bizCode", "x"])
_tools.mnnconvert(["mnnconvert", "-f", "MNN", "--modelFile", "a.mnn", "--JsonFile", "a.json"])
net = json.load(open("a.json"))
(const,) = [op for op in net["oplists"] if op["type"] == "Const"]
del const["main"]["float32s"]
const["main"]["external"] = [0, 4 * int(sys.argv[3])]  # offset, length in that file
const["externalPath"] = path
json.dump(net, open("b.json", "w"))
_tools.mnnconvert(["mnnconvert", "-f", "JSON", "--modelFile", "b.json", "--MNNModel", "b.mnn",
                   "--bizCode", "x"])
"""


def _mnn_pointing_at(path: str, workdir) -> bytes:
    """Build an .mnn whose one constant tells MNN to read its weights from `path`."""
    weight = numpy_helper.from_array(np.ones((1, WIDTH), np.float32), "w")
    source = workdir / "plain.onnx"
    source.write_bytes(_onnx([helper.make_node("Add", ["x", "w"], ["y"])], [weight]))
    subprocess.run(
        [sys.executable, "-c", _MAKE_MNN_WITH_EXTERNAL_PATH, str(source), path, str(WIDTH)],
        cwd=workdir,
        capture_output=True,
        check=True,
    )
    model = (workdir / "b.mnn").read_bytes()
    assert mnn_flatbuffer.external_paths(model) == [path]
    return model


def _constant_of_shape_onnx(count: int) -> bytes:
    """y = x + ConstantOfShape([1, count]): a few hundred bytes that expand to count floats."""
    shape = numpy_helper.from_array(np.array([1, count], np.int64), "shape")
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    nodes = [
        helper.make_node("ConstantOfShape", ["shape"], ["big"], value=one),
        helper.make_node("Add", ["x", "big"], ["y"]),
    ]
    return _onnx(nodes, [shape], width=count)


def _push_fails(cp, tmp_path, data: bytes, caplog, **kwargs) -> str:
    """Push `data`; return the error, having checked nothing was stored or leaked."""
    path = tmp_path / "hostile.model"
    path.write_bytes(data)
    secret = _keyset(cp)
    with caplog.at_level(logging.DEBUG), cp.client() as client:
        with pytest.raises(errors.InvalidArgument) as caught:
            client.push(path, name="hostile", **kwargs)
    assert cp.registry.store.list_models() == []
    assert list(cp.registry.blobs.keys()) == []
    message = str(caught.value)
    for window in (secret[i : i + 16] for i in range(0, len(secret) - 16, 8)):
        assert window not in message.encode() and window not in caplog.text.encode()
    return message


# --- the keyset ---------------------------------------------------------------------------


def test_mnn_model_pointing_at_the_keyset_fails_its_push(cp, tmp_path, caplog):
    # Unchecked, MNN reads the keyset into the constant and the int8 variant carries it
    # in plain bytes, for the uploader to pull.
    model = _mnn_pointing_at(str(cp.config.kek), tmp_path)
    message = _push_fails(cp, tmp_path, model, caplog, variants=("int8",))
    assert message.endswith(": ops that read weights from external files are not supported")


@pytest.mark.parametrize("how", ["absolute", "traversal"])
def test_onnx_external_data_pointing_at_the_keyset_fails_its_push(cp, tmp_path, caplog, how):
    kek = str(cp.config.kek)
    # MNN resolves locations against the model's directory, which for a memfd is /proc/self/fd.
    location = kek if how == "absolute" else os.path.relpath(kek, "/proc/self/fd")
    message = _push_fails(cp, tmp_path, _external_weight_onnx(location), caplog)
    assert message.endswith("tensors stored as external data are not supported")


# --- memory ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_unbounded_allocation_fails_its_push_naming_the_limit(cp, tmp_path, caplog):
    # 2**28 floats: 1 GiB for the constant alone, twice the 512 MiB the fixture allows.
    message = _push_fails(cp, tmp_path, _constant_of_shape_onnx(2**28), caplog)
    assert "0.5 GiB memory limit (mnn_memory_limit_bytes)" in message


# --- the child's confinement ---------------------------------------------------------------


def test_the_mnn_child_is_confined(tmp_path, monkeypatch):
    secret = tmp_path / "home" / "keys" / "kek.json"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(b"key material")
    secret.chmod(0o600)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "must-not-reach-the-child")
    monkeypatch.setattr(mnn_tools, "WORKER_MODULE", "tests.control_plane.sandbox_probe")
    sandbox = Sandbox.create(memory_bytes=1 << 30, cpu_seconds=30)
    model = os.memfd_create("probe-model", os.MFD_CLOEXEC)
    os.write(model, b"model bytes")
    try:
        args = ["--model-fd", str(model), "--secret", str(secret)]
        payload = mnn_tools.run_worker("probe", args, (model,), 60, "probe", sandbox)
    finally:
        os.close(model)
    found, confinement = payload["findings"], payload["confinement"]
    # Nothing of ours, no credentials: only the package path, and the UTF-8 locale the
    # interpreter sets for itself in a C locale (PEP 538).
    assert set(found["env"]) <= {"PYTHONPATH", "LC_CTYPE"}
    # stdin, stdout, stderr, the result, the model, and the probe's own listing of them
    assert len(found["fds"]) == 6 and found["fds"][:3] == [0, 1, 2]
    assert not found["cwd"].startswith(str(tmp_path / "home"))
    # Modules planted in the working directory are never imported (the child imports
    # while still root), and the directory cannot be found by listing its parent.
    assert found["cwd_on_path"] is False
    if os.geteuid() == 0:
        assert found["parent_listing"] == "PermissionError"
    assert found["model"] == "ok"
    assert found["secret"] == "PermissionError"
    assert found["socket"] == found["exec"] == found["fork"] == "PermissionError"
    assert found["dumpable"] is False and found["rlimit_core"] == 0
    assert (found["rlimit_as"], found["rlimit_cpu"]) == (1 << 30, 30)
    assert confinement["seccomp"] == "on"
    if os.geteuid() == 0:
        assert confinement["uid"] != 0


def test_without_libseccomp_the_child_degrades_and_the_parent_logs_once(caplog, monkeypatch):
    script = textwrap.dedent(
        """
        import json, sys
        sys.modules["pyseccomp"] = None  # as if libseccomp were missing
        from runtime.hardening import confine
        print(json.dumps(confine(memory_bytes=1 << 30, cpu_seconds=30).to_dict()))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    confinement = json.loads(out)
    assert confinement["seccomp"].startswith("off: libseccomp is not available")
    monkeypatch.setattr(mnn_tools, "_warned_unconfined", False)
    result = json.dumps({"ok": True, "confinement": confinement})
    with caplog.at_level(logging.WARNING, logger="control_plane.registry.mnn_tools"):
        for _ in range(3):
            assert mnn_tools._outcome(0, result, "", "p")["ok"]
    warnings = [r for r in caplog.records if "without a seccomp filter" in r.message]
    assert len(warnings) == 1


def test_flatbuffer_walk_survives_garbage():
    rng = np.random.default_rng(7)
    for size in (0, 3, 16, 64, 4096):
        for _ in range(50):
            data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
            try:
                mnn_flatbuffer.external_paths(data)
            except mnn_flatbuffer.MalformedModel:
                pass
