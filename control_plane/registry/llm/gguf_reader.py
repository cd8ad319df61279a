"""`gguf.GGUFReader`, reading its metadata from a plain array view of the file's map.

The stock reader slices its `numpy.memmap` for every value it parses: a few Python calls
of the memmap subclass each time (`__getitem__`, `__array_finalize__`), twice per string.
A vocabulary is hundreds of thousands of strings: Gemma 3's 262k tokens took 20-26 s to
open on a loaded 2-core machine, 8-9 s through this reader. Slicing an `ndarray` view of
the same map gives the same bytes (nothing is copied; the view keeps the map alive).
gguf-py's own fix (ggml-org/llama.cpp#13378, open) reads with file I/O instead.

Only `_get`, the reader's one slicing helper, is replaced. A gguf release that changes
what it must return is caught by tests/control_plane/registry/llm/test_gguf_reader.py,
which compares every field and tensor with the stock reader's; one that renames it only
loses the speed.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import numpy as np


@functools.cache
def _reader_class() -> type:
    import gguf

    class Reader(gguf.GGUFReader):
        """A GGUFReader whose metadata reads slice a plain ndarray, not the memmap."""

        def _get(
            self, offset: int, dtype: Any, count: int = 1, override_order: str | None = None
        ) -> np.ndarray:
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            end = offset + np.dtype(dtype).itemsize * count
            arr = plain[offset:end].view(dtype=dtype)[:count]
            order = self.byte_order if override_order is None else override_order
            return arr.view(arr.dtype.newbyteorder(order))

    return Reader


def gguf_reader(path: str | os.PathLike[str]):
    """Return a `gguf.GGUFReader` of `path` (read-only), parsed through `_reader_class`."""
    return _reader_class()(os.fspath(path), "r")
