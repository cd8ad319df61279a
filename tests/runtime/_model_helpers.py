"""Real small models for the runtime tests: built as ONNX, converted by MNN's converter.

Each model is converted once per test session (the converter runs in a child process).
"""

from __future__ import annotations

import functools

import numpy as np
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from control_plane.demo.sample_models import onnx_to_mnn_bytes, tiny_mlp_onnx
from runtime.backends import Backend, BackendConfig, Precision

CPU_1 = BackendConfig(Backend.CPU, Precision.NORMAL, 1)
CPU_1_LOW = BackendConfig(Backend.CPU, Precision.LOW, 1)
CPU_1_HIGH = BackendConfig(Backend.CPU, Precision.HIGH, 1)
OPENCL = BackendConfig(Backend.OPENCL, Precision.NORMAL, 4)


@functools.cache
def tiny_onnx(seed: int = 0) -> bytes:
    """A 16 -> 32 -> 4 MLP, input "x" [1, 16] float32, output "y"."""
    return tiny_mlp_onnx(seed=seed)


@functools.cache
def tiny_mnn(seed: int = 0) -> bytes:
    return onnx_to_mnn_bytes(tiny_onnx(seed))


@functools.cache
def log_onnx() -> bytes:
    """y = log(x @ w) with a dynamic batch: NaN for inputs that make x @ w negative."""
    w = np.abs(np.random.default_rng(3).standard_normal((8, 3))).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["m"]), helper.make_node("Log", ["m"], ["y"])],
        "skiff_log",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@functools.cache
def log_mnn() -> bytes:
    return onnx_to_mnn_bytes(log_onnx())


@functools.cache
def two_input_onnx() -> bytes:
    """Inputs "x" float32 [2, 3] and "i" int32 [2, 3]; outputs "sum" = x + i, "sq" = x * x."""
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
            helper.make_node("Add", ["x", "f"], ["sum"]),
            helper.make_node("Mul", ["x", "x"], ["sq"]),
        ],
        "skiff_two_inputs",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("i", TensorProto.INT32, [2, 3]),
        ],
        [
            helper.make_tensor_value_info("sum", TensorProto.FLOAT, [2, 3]),
            helper.make_tensor_value_info("sq", TensorProto.FLOAT, [2, 3]),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


@functools.cache
def two_input_mnn() -> bytes:
    return onnx_to_mnn_bytes(two_input_onnx())


def reference(onnx_bytes: bytes, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the ONNX model with onnx's reference evaluator (the ground truth)."""
    evaluator = ReferenceEvaluator(onnx_bytes)
    names = [o.name for o in evaluator.proto_.graph.output]
    return dict(zip(names, evaluator.run(None, inputs), strict=True))


def x16(seed: int = 0, batch: int = 1) -> dict[str, np.ndarray]:
    """Random inputs for the tiny MLP."""
    return {"x": np.random.default_rng(seed).standard_normal((batch, 16)).astype(np.float32)}
