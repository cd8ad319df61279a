"""Find the ops of an .mnn file that tell MNN to read weights from another file.

An MNN op may carry ``externalPath``: MNN then reads its weights from that path when it
loads or converts the model. In an uploaded model that path is the uploader's choice, so
"/srv/skiff/keys/kek.json" would copy the server's key file into the constant, and from
there into a quantised variant the uploader can pull. The worker refuses such models
before MNN opens them. (Without ``externalPath`` MNN falls back to "<model path>.weight",
which for a model opened as /proc/self/fd/N cannot exist.)

A minimal, bounds-checked flatbuffer walk over the three tables involved, from MNN's
schema (schema/default/MNN.fbs, MNN 3.x); no generated code needed.
"""

from __future__ import annotations

import struct

__all__ = ["MalformedModel", "external_paths"]

# Field slots (a union takes two: its type, then its value).
_NET_OPLISTS, _NET_SUBGRAPHS = 3, 10  # table Net { bizCode, extraTensorDescribe, extraInfo, ...
_SUBGRAPH_NODES = 4  # table SubGraphProto { name, inputs, outputs, tensors, nodes, ... }
_OP_EXTERNAL_PATH = 7  # table Op { inputIndexes, main (2), name, outputIndexes, type, fmt, ...
_MAX_OPS = 10_000_000  # far above any real model; bounds the walk of hostile input


class MalformedModel(ValueError):
    """The flatbuffer points outside itself."""


def external_paths(data: bytes | memoryview) -> list[str]:
    """Return the externalPath of every op (subgraphs included) that has one."""
    buf = memoryview(data)
    root = _u32(buf, 0)
    ops = _vector(buf, root, _NET_OPLISTS)
    for subgraph in _vector(buf, root, _NET_SUBGRAPHS):
        ops += _vector(buf, subgraph, _SUBGRAPH_NODES)
    found = []
    for op in ops:
        pos = _field(buf, op, _OP_EXTERNAL_PATH)
        if pos is not None:
            found.append(_string(buf, pos))
    return found


def _field(buf: memoryview, table: int, slot: int) -> int | None:
    """Return the position of a table's field, or None when it is absent."""
    vtable = table - _i32(buf, table)
    size = _u16(buf, vtable)
    if 4 + 2 * slot + 2 > size:
        return None
    offset = _u16(buf, vtable + 4 + 2 * slot)
    return table + offset if offset else None


def _vector(buf: memoryview, table: int, slot: int) -> list[int]:
    """Return the positions of the tables a vector-of-tables field points at."""
    pos = _field(buf, table, slot)
    if pos is None:
        return []
    start = pos + _u32(buf, pos)
    count = _u32(buf, start)
    if count > _MAX_OPS or start + 4 + 4 * count > len(buf):
        raise MalformedModel("vector runs past the end of the model")
    return [start + 4 + 4 * i + _u32(buf, start + 4 + 4 * i) for i in range(count)]


def _string(buf: memoryview, pos: int) -> str:
    start = pos + _u32(buf, pos)
    length = _u32(buf, start)
    if start + 4 + length > len(buf):
        raise MalformedModel("string runs past the end of the model")
    return bytes(buf[start + 4 : start + 4 + length]).decode(errors="replace")


def _read(fmt: str, buf: memoryview, pos: int) -> int:
    if pos < 0 or pos + struct.calcsize(fmt) > len(buf):
        raise MalformedModel("offset points outside the model")
    return struct.unpack_from(fmt, buf, pos)[0]


def _u32(buf: memoryview, pos: int) -> int:
    return _read("<I", buf, pos)


def _i32(buf: memoryview, pos: int) -> int:
    return _read("<i", buf, pos)


def _u16(buf: memoryview, pos: int) -> int:
    return _read("<H", buf, pos)
