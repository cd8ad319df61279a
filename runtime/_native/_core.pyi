"""Type stubs of the private extension module (the facade is runtime.stream)."""

from typing import Any

import numpy as np
from numpy.typing import NDArray

class Engine:
    def __init__(
        self,
        n_types: int,
        n_keys: int,
        value_names: list[str],
        lateness: int,
        max_keys: int,
        ttl: int,
    ) -> None: ...
    def add_trigger(
        self,
        by: int,
        within: int,
        steps: list[tuple[int, int, list[tuple[bool, int, int, float, int]]]],
        features: list[tuple[int, int, int, int, int, list[float]]],
    ) -> int: ...
    def remove_trigger(self, trigger: int) -> None: ...
    def snapshot(self) -> bytes: ...
    def restore(self, payload: bytes) -> None: ...
    def push_batch(
        self,
        ts: NDArray[np.int64],
        types: NDArray[np.int32],
        keys: NDArray[np.int64],
        values: NDArray[np.float64],
    ) -> dict[str, Any]: ...
    def stats(self) -> dict[str, Any]: ...
