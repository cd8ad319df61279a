"""Read and write ``.npz`` archives of named arrays, safely and exactly.

numpy's own `np.load` and `np.savez` are close but not enough for data that crosses a
trust boundary (a publisher's golden inputs, a model's outputs):

* `np.load` trusts each member's header and allocates what it declares before reading,
  so a few bytes can ask for gigabytes; here every header is read and the declared sizes
  are summed against a limit first.
* It looks members up by name with or without ``.npy``, so arrays called ``a`` and
  ``a.npy`` collide; here a member is found by its exact name, and every member must be
  an ``.npy`` file.
* `np.savez(file, **arrays)` cannot store arrays called ``file`` or ``allow_pickle``;
  `write_npz` takes a mapping.

Object arrays (which need pickle) are refused outright.
"""

from __future__ import annotations

import io
import math
import zipfile
import zlib
from collections.abc import Mapping

import numpy as np
from numpy.lib import format as npy

__all__ = ["read_npz", "write_npz"]

_SUFFIX = ".npy"
MAX_MEMBERS = 4096


def write_npz(arrays: Mapping[str, np.ndarray], *, compress: bool = False) -> bytes:
    """Return `arrays` as an ``.npz`` (member ``<name>.npy`` per array, in order)."""
    buffer = io.BytesIO()
    method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED
    with zipfile.ZipFile(buffer, "w", method) as archive:
        for name, array in arrays.items():
            with archive.open(name + _SUFFIX, "w", force_zip64=True) as member:
                npy.write_array(member, np.asanyarray(array), allow_pickle=False)
    return buffer.getvalue()


def read_npz(data: bytes, what: str, limit: int) -> dict[str, np.ndarray]:
    """Return the arrays of an ``.npz`` by name; ValueError naming `what` if it is not one.

    `limit` bounds the arrays' total size in bytes as their headers declare it, checked
    before any array is read.
    """
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = archive.infolist()
            _check_members(members)
            shapes = [_header(archive, m) for m in members]
            total = sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes)
            if total > limit:
                raise ValueError(f"its arrays take more than {limit:,} bytes")
            return {m.filename[: -len(_SUFFIX)]: _read(archive, m) for m in members}
    # RuntimeError: an encrypted member; NotImplementedError: an unknown compression.
    except (
        zipfile.BadZipFile,
        zlib.error,
        OSError,
        EOFError,
        ValueError,
        MemoryError,
        RuntimeError,
        NotImplementedError,
    ) as exc:
        raise ValueError(f"{what} is not a valid .npz: {exc}") from None


def _check_members(members: list[zipfile.ZipInfo]) -> None:
    if len(members) > MAX_MEMBERS:
        raise ValueError(f"more than {MAX_MEMBERS} arrays")
    names = [m.filename for m in members]
    if len(set(names)) != len(names):
        raise ValueError("an array name appears twice")
    odd = next((n for n in names if not n.endswith(_SUFFIX)), None)
    if odd is not None:
        raise ValueError(f"member {odd[:64]!r} is not an .npy array")


def _header(archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> tuple[tuple, np.dtype]:
    with archive.open(member) as f:
        version = npy.read_magic(f)
        if version == (1, 0):
            shape, _, dtype = npy.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, _, dtype = npy.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
    if dtype.hasobject:
        raise ValueError(f"{member.filename[:64]!r} holds Python objects (needs pickle)")
    return shape, dtype


def _read(archive: zipfile.ZipFile, member: zipfile.ZipInfo) -> np.ndarray:
    with archive.open(member) as f:
        return npy.read_array(f, allow_pickle=False)
