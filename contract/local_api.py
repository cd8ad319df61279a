"""The agent's local API as apps see it: where its socket is, and tensors as messages.

Apps on a device (and the demo's walkthroughs) call `AgentService` (protos/agent.proto)
on a Unix socket in the agent's state directory; tensors travel as raw little-endian
bytes with a dtype and a shape, bounded so a request cannot make the agent allocate
without limit.
"""

from __future__ import annotations

import os
from pathlib import Path

from protos import agent_pb2

TYPE_CHECKING = False  # numpy is imported where a tensor is converted: an idle agent has none
if TYPE_CHECKING:
    import numpy as np

SOCKET_NAME = "agent.sock"
# sockaddr_un.sun_path holds 108 bytes with its NUL.
MAX_SOCKET_PATH = 107
MAX_MESSAGE_BYTES = 64 << 20
MAX_TENSORS = 64
MAX_RANK = 8
DTYPES = frozenset(
    {
        "float16",
        "float32",
        "float64",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "bool",
    }
)


class BadTensor(ValueError):
    """A tensor in a request cannot be read as an array."""


class SocketPathTooLong(ValueError):
    """A state directory too deep for its socket's path to fit a sockaddr_un."""


def socket_path(state_dir: Path) -> Path:
    """Return the local API socket of a state directory (its length checked)."""
    path = Path(os.path.abspath(state_dir)) / SOCKET_NAME
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise SocketPathTooLong(
            f"{path}: a Unix socket path must be at most {MAX_SOCKET_PATH} bytes; "
            "use a shorter --state path"
        )
    return path


def to_array(t: agent_pb2.Tensor) -> np.ndarray:
    """Return a Tensor message as a numpy array; BadTensor names what is wrong."""
    import numpy as np

    name = t.name or "(unnamed)"
    if t.dtype not in DTYPES:
        raise BadTensor(
            f"tensor {name!r:.60}: dtype {t.dtype!r:.30} is not one of {sorted(DTYPES)}"
        )
    if len(t.shape) > MAX_RANK or any(d < 0 for d in t.shape):
        raise BadTensor(f"tensor {name!r:.60}: shape {list(t.shape)[:10]} is not a valid shape")
    dtype = np.dtype(t.dtype).newbyteorder("<")
    count = nonzero = 1
    for d in t.shape:
        count *= d
        nonzero *= max(d, 1)
    if nonzero > MAX_MESSAGE_BYTES:  # a zero dim must not let huge others through to numpy
        raise BadTensor(f"tensor {name!r:.60}: shape {list(t.shape)[:10]} is too large")
    if count * dtype.itemsize != len(t.data):
        raise BadTensor(
            f"tensor {name!r:.60}: {len(t.data)} bytes do not hold shape {list(t.shape)} "
            f"of {t.dtype} ({count * dtype.itemsize} bytes)"
        )
    return np.frombuffer(t.data, dtype=dtype).reshape(tuple(t.shape)).astype(t.dtype, copy=False)


def to_tensor(name: str, array: np.ndarray) -> agent_pb2.Tensor:
    """Return an array as a Tensor message (C order, little-endian)."""
    import numpy as np

    array = np.asarray(array)
    little = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return agent_pb2.Tensor(
        name=name, dtype=array.dtype.name, shape=list(array.shape), data=little.tobytes()
    )
