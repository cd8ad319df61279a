"""A model's inputs and outputs as MNN reports them, and the check of a caller's inputs.

MNN's converter records every input with the shape it was exported with (a dynamic
batch dimension is written as 1, other dynamic dims as -1) and resizes the graph when fed
another shape, so the shape in the signature is a default, not a contract. The check is
therefore strict on names, dtypes and ranks, which MNN does not verify (an int32 array
fed to a float input silently gives garbage), and lets other dims through for MNN to
accept or refuse.

The converter also narrows int64 inputs to int32 (Silero VAD's sample rate, token ids),
while callers naturally feed what the original model took: int64 arrays are accepted for
int32 inputs and narrowed, if every value fits (anything else is refused, never wrapped).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from runtime.errors import InvalidInput

__all__ = ["Signature", "TensorSpec"]

# Dtypes MNN's Python API can feed and return, by numpy name.
SUPPORTED_DTYPES = ("float32", "float64", "int32", "int64", "int8", "uint8")


@dataclass(frozen=True)
class TensorSpec:
    """One model input: its name, exported shape, numpy dtype name and MNN layout.

    ``layout`` is MNN's data format: "NCHW" or "NHWC" arrays are fed as they are;
    "NC4HW4" (MNN's packed layout, from some Caffe models) is fed as NCHW and converted.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str = "NCHW"

    @property
    def dynamic_dims(self) -> tuple[int, ...]:
        """Return the axes whose size is unknown until run time (exported as -1)."""
        return tuple(axis for axis, n in enumerate(self.shape) if n < 0)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict; `from_dict` reverses it."""
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "layout": self.layout,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TensorSpec:
        """Rebuild a spec from `to_dict` output."""
        shape = tuple(int(n) for n in d["shape"])
        return cls(str(d["name"]), shape, str(d["dtype"]), str(d.get("layout", "NCHW")))


@dataclass(frozen=True)
class Signature:
    """Named inputs (with exported shapes) and named outputs of one model.

    Output shapes depend on the inputs (batching), so only output names are known
    before a run.
    """

    inputs: tuple[TensorSpec, ...]
    outputs: tuple[str, ...]
    _checks: tuple[tuple[TensorSpec, np.dtype], ...] = field(init=False, repr=False, compare=False)
    _names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for spec in self.inputs:
            if spec.dtype not in SUPPORTED_DTYPES:
                raise ValueError(
                    f"input {spec.name!r} has dtype {spec.dtype}, which MNN's Python API "
                    "cannot feed"
                )
        checks = tuple((spec, np.dtype(spec.dtype)) for spec in self.inputs)
        object.__setattr__(self, "_checks", checks)
        object.__setattr__(self, "_names", frozenset(spec.name for spec in self.inputs))

    @property
    def input_names(self) -> tuple[str, ...]:
        """Return the input names in the order MNN takes them."""
        return tuple(spec.name for spec in self.inputs)

    def check(self, inputs: Mapping[str, np.ndarray]) -> tuple[list[np.ndarray], bool]:
        """Validate `inputs`; return them in model order and whether all shapes are exported.

        Raises InvalidInput naming the first problem: a missing or unexpected name, a value
        that is not an ndarray, a dtype or rank that differs from the model's, an empty
        dimension. Non-contiguous arrays are copied to contiguous ones.
        """
        # This runs on every inference: plain comparisons first, messages only on failure.
        if type(inputs) is not dict and not isinstance(inputs, Mapping):
            kind = type(inputs).__name__
            raise InvalidInput(f"inputs must be a dict of name -> numpy.ndarray, not {kind}")
        if inputs.keys() != self._names:
            raise InvalidInput(self._names_problem(inputs))
        arrays, exact = [], True
        for spec, dtype in self._checks:
            array = inputs[spec.name]
            if type(array) is not np.ndarray and not isinstance(array, np.ndarray):
                kind = type(array).__name__
                raise InvalidInput(f"input {spec.name!r} must be a numpy.ndarray, not {kind}")
            if array.dtype != dtype:
                array = _narrowed(spec, dtype, array)
            if array.shape != spec.shape:
                self._check_shape(spec, array.shape)
                exact = False
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array)
            arrays.append(array)
        return arrays, exact

    def _names_problem(self, inputs: Mapping[str, Any]) -> str:
        """Describe how the given input names differ from the model's."""
        wanted = self.input_names
        missing = [n for n in wanted if n not in inputs]
        unexpected = [n for n in inputs if n not in wanted]
        parts = []
        if missing:
            parts.append(f"missing {missing}")
        if unexpected:
            parts.append(f"unexpected {unexpected}")
        return f"inputs do not match the model ({', '.join(parts)}); it takes {list(wanted)}"

    @staticmethod
    def _check_shape(spec: TensorSpec, shape: tuple[int, ...]) -> None:
        """Refuse shapes MNN must never see: another rank, or an empty dimension."""
        if len(shape) != len(spec.shape):
            raise InvalidInput(
                f"input {spec.name!r} has shape {shape}; the model takes rank "
                f"{len(spec.shape)}, e.g. {spec.shape}"
            )
        if 0 in shape:
            raise InvalidInput(f"input {spec.name!r} has an empty dimension: {shape}")

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict; `from_dict` reverses it."""
        return {"inputs": [s.to_dict() for s in self.inputs], "outputs": list(self.outputs)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Signature:
        """Rebuild a signature from `to_dict` output (e.g. a worker's reply)."""
        inputs = tuple(TensorSpec.from_dict(item) for item in d["inputs"])
        return cls(inputs, tuple(str(name) for name in d["outputs"]))


_INT32 = np.iinfo(np.int32)


def _narrowed(spec: TensorSpec, dtype: np.dtype, array: np.ndarray) -> np.ndarray:
    """Return int64 `array` as int32 for an int32 input; InvalidInput for any other mismatch."""
    if dtype != np.int32 or array.dtype != np.int64:
        raise InvalidInput(f"input {spec.name!r} has dtype {array.dtype}; the model takes {dtype}")
    if array.size and (array.min() < _INT32.min or array.max() > _INT32.max):
        raise InvalidInput(
            f"input {spec.name!r} holds int64 values outside int32, which the converted "
            "model takes (MNN's converter narrows int64 inputs)"
        )
    return array.astype(np.int32)
