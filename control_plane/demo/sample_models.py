"""Real, small ONNX models built in memory with `onnx.helper`, for tests, demos and benches.

Every model is an MLP: a chain of ``MatMul -> Add -> Relu`` layers ending in
``MatMul -> Add``, float32, input ``x`` of shape ``[1, n]`` and output ``y``. Nothing is
downloaded and nothing touches the disk.

Large models are assembled at the protobuf wire level: the graph skeleton (nodes, inputs,
outputs) is serialised by `onnx`, and each initializer is appended as its own
length-delimited record. Protobuf parsers merge repeated fields wherever they appear, so the
result is an ordinary ``ModelProto``, and only one layer's weights exist as a numpy array at
any moment instead of the whole model being held twice (as a proto and as its serialisation).
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator

import numpy as np
from onnx import TensorProto, helper

from control_plane.files import write_all

__all__ = [
    "tiny_mlp_onnx",
    "sized_mlp_onnx",
    "write_sized_mlp_onnx",
    "unconvertible_onnx",
    "onnx_to_mnn_bytes",
]

_OPSET = 17
_IR_VERSION = 8  # what opset 17 needs; old enough for MNN's bundled ONNX reader
_MAX_SQUARE_DIM = 2048  # 16 MiB per weight matrix: big models are long chains, not huge tensors
_GRAPH_FIELD = 7  # ModelProto.graph
_INITIALIZER_FIELD = 5  # GraphProto.initializer
_RAW_DATA_FIELD = 9  # TensorProto.raw_data
_LEN = 2  # protobuf wire type for length-delimited fields


def tiny_mlp_onnx(inputs: int = 16, hidden: int = 32, outputs: int = 4, seed: int = 0) -> bytes:
    """Return a two-layer MLP (``inputs -> hidden -> outputs``) as serialised ONNX."""
    return b"".join(_mlp_chunks([inputs, hidden, outputs], seed))


def sized_mlp_onnx(target_bytes: int, seed: int = 0) -> bytes:
    """Return an MLP whose float32 weights total about `target_bytes`, as serialised ONNX."""
    # BytesIO.getvalue() hands over its buffer without copying when nothing else refers to
    # it, so the peak is one model plus one layer, not two models.
    buffer = io.BytesIO()
    for chunk in _mlp_chunks(_sized_dims(target_bytes), seed):
        buffer.write(chunk)
    return buffer.getvalue()


def write_sized_mlp_onnx(fd: int, target_bytes: int, seed: int = 0) -> int:
    """Stream the model `sized_mlp_onnx` would return into `fd`; return the bytes written."""
    written = 0
    for chunk in _mlp_chunks(_sized_dims(target_bytes), seed):
        view = memoryview(chunk)
        while view:
            count = os.write(fd, view)
            view = view[count:]
            written += count
    return written


def unconvertible_onnx() -> bytes:
    """Return a well-formed ONNX model that MNN's converter refuses (an op it does not know)."""
    graph = helper.make_graph(
        [helper.make_node("SkiffNoSuchOp", ["x"], ["y"])],
        "skiff_unconvertible",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", _OPSET)])
    model.ir_version = _IR_VERSION
    return model.SerializeToString()


def onnx_to_mnn_bytes(onnx_bytes: bytes) -> bytes:
    """Convert ONNX bytes to .mnn bytes with the real converter, via memfds only."""
    from control_plane.registry import mnn_tools  # late: keeps this module usable without MNN work

    src = os.memfd_create("skiff-sample-onnx", os.MFD_CLOEXEC)
    try:
        write_all(src, onnx_bytes)
        dst = mnn_tools.convert_onnx(src)
    finally:
        os.close(src)
    try:
        return _read_all(dst)
    finally:
        os.close(dst)


def _sized_dims(target_bytes: int) -> list[int]:
    """Pick square layer widths so that the weight matrices total about `target_bytes`."""
    if target_bytes <= 0:
        raise ValueError("target_bytes must be positive")
    # Aim for at least four layers so small targets still make a real chain.
    width = math.isqrt(target_bytes // 16) // 16 * 16
    width = max(16, min(_MAX_SQUARE_DIM, width))
    layers = max(1, round(target_bytes / (4 * width * width)))
    return [width] * (layers + 1)


def _mlp_chunks(dims: list[int], seed: int) -> Iterator[bytes]:
    """Yield the serialised model for layer widths `dims` piece by piece."""
    names = [(f"w{i}", f"b{i}") for i in range(len(dims) - 1)]
    specs = [((w, (dims[i], dims[i + 1])), (b, (dims[i + 1],))) for i, (w, b) in enumerate(names)]
    records = [(name, shape) for pair in specs for name, shape in pair]
    head = _graph_head(dims, names)
    graph_len = len(head) + sum(_record_len(name, shape) for name, shape in records)
    model = helper.make_model(
        helper.make_graph([], "skiff_sample", [], []),
        opset_imports=[helper.make_opsetid("", _OPSET)],
        producer_name="skiff.sample_models",
    )
    model.ir_version = _IR_VERSION
    model.ClearField("graph")
    yield model.SerializeToString() + _key(_GRAPH_FIELD) + _varint(graph_len) + head
    rng = np.random.default_rng(seed)
    for (w_name, w_shape), (b_name, b_shape) in specs:
        # He-style scaling keeps activations finite through long Relu chains.
        weight = rng.standard_normal(w_shape, dtype=np.float32) * np.float32(
            math.sqrt(2.0 / w_shape[0])
        )
        yield _record(w_name, w_shape, weight.tobytes())
        del weight
        bias = rng.standard_normal(b_shape, dtype=np.float32) * np.float32(0.1)
        yield _record(b_name, b_shape, bias.tobytes())


def _graph_head(dims: list[int], names: list[tuple[str, str]]) -> bytes:
    """Serialise the graph's nodes, input and output, without any initializer."""
    nodes, current = [], "x"
    for i, (w_name, b_name) in enumerate(names):
        last = i == len(names) - 1
        matmul, added = f"mm{i}", "y" if last else f"add{i}"
        nodes.append(helper.make_node("MatMul", [current, w_name], [matmul]))
        nodes.append(helper.make_node("Add", [matmul, b_name], [added]))
        if not last:
            current = f"relu{i}"
            nodes.append(helper.make_node("Relu", [added], [current]))
    graph = helper.make_graph(
        nodes,
        "skiff_sample",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, dims[0]])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, dims[-1]])],
    )
    return graph.SerializeToString()


def _tensor_head(name: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """Serialise a float32 TensorProto header followed by the raw_data tag and length."""
    tensor = TensorProto(name=name, dims=shape, data_type=TensorProto.FLOAT)
    return tensor.SerializeToString() + _key(_RAW_DATA_FIELD) + _varint(nbytes)


def _record_len(name: str, shape: tuple[int, ...]) -> int:
    """Return the encoded size of one initializer record, without building its data."""
    body = len(_tensor_head(name, shape, 4 * math.prod(shape))) + 4 * math.prod(shape)
    return len(_key(_INITIALIZER_FIELD)) + len(_varint(body)) + body


def _record(name: str, shape: tuple[int, ...], raw: bytes) -> bytes:
    """Encode one initializer as a GraphProto.initializer field."""
    head = _tensor_head(name, shape, len(raw))
    return _key(_INITIALIZER_FIELD) + _varint(len(head) + len(raw)) + head + raw


def _key(field: int) -> bytes:
    """Return the tag of a length-delimited protobuf field."""
    return _varint(field << 3 | _LEN)


def _varint(value: int) -> bytes:
    """Encode a non-negative integer as a protobuf varint."""
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_all(fd: int) -> bytes:
    """Read the whole file behind `fd` without moving its offset."""
    return os.pread(fd, os.fstat(fd).st_size, 0)
