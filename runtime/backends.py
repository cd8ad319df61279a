"""Backend configs: which MNN backend, precision, thread count and memory mode to run with.

A `BackendConfig` is what the probe measures, the fallback chain walks, telemetry
reports and the fleet recommends per device class, so it is a small frozen value with a
stable string key (``"CPU/normal/t2/mem-normal"``) and a dict form.

The enum values are MNN's own numbers (``MNNForwardType``, ``BackendConfig::PrecisionMode``,
``BackendConfig::MemoryMode``), so they can be handed to MNN as they are.
"""

from __future__ import annotations

import enum
import os
import sys
from dataclasses import dataclass
from typing import Any

__all__ = [
    "DEFAULT_CONFIG",
    "GPU_MODE",
    "REFERENCE_CONFIG",
    "Backend",
    "BackendConfig",
    "MemoryMode",
    "Precision",
    "candidate_configs",
]


class _Named(enum.IntEnum):
    """An IntEnum that prints as its name (plain IntEnum prints its number)."""

    def __str__(self) -> str:
        return self.name


class Backend(_Named):
    """An MNN backend, numbered as MNN's ``MNNForwardType``."""

    CPU = 0
    METAL = 1
    CUDA = 2
    OPENCL = 3
    NN = 5  # NNAPI on Android, CoreML on Apple
    OPENGL = 6
    VULKAN = 7
    HIAI = 8  # MNN_FORWARD_USER_0
    TRT = 9  # MNN_FORWARD_USER_1

    @classmethod
    def from_forward_type(cls, value: int) -> Backend:
        """Map the forward type MNN reports for a session to the backend a caller asked for.

        MNN reports 13 (``MNN_FORWARD_CPU_EXTENSION``) when its CPU backend runs with an
        instruction-set extension (AVX2, ARMv8.2 fp16): that is still the CPU backend.
        """
        return cls.CPU if value == _CPU_EXTENSION else cls(value)


class Precision(_Named):
    """MNN's ``PrecisionMode``: LOW lets a backend use fp16 (or bf16) arithmetic."""

    NORMAL = 0
    HIGH = 1
    LOW = 2
    LOW_BF16 = 3


class MemoryMode(_Named):
    """MNN's ``MemoryMode``: LOW dequantises weight-quantised layers on the fly."""

    NORMAL = 0
    HIGH = 1
    LOW = 2


_CPU_EXTENSION = 13
# GPU backends read ScheduleConfig.numThread as mode bits, not a thread count; 4 is
# MNN_GPU_TUNING_WIDE, MNN's own default for them.
GPU_MODE = 4
_MAX_CPU_THREADS = 4  # more threads than big cores only adds contention on phones


def _enum(kind: type[enum.IntEnum], value: Any) -> Any:
    """Coerce an enum member, its int value or its (case-insensitive) name to a member."""
    if isinstance(value, kind):
        return value
    if isinstance(value, str):
        try:
            return kind[value.upper()]
        except KeyError:
            names = ", ".join(m.name for m in kind)
            message = f"unknown {kind.__name__} {value!r}; expected one of {names}"
            raise ValueError(message) from None
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"unknown {kind.__name__} {value!r}") from None


@dataclass(frozen=True)
class BackendConfig:
    """One way to run a model: backend x precision x threads x memory mode."""

    backend: Backend = Backend.CPU
    precision: Precision = Precision.NORMAL
    threads: int = 1
    memory: MemoryMode = MemoryMode.NORMAL

    def __post_init__(self) -> None:
        # Accept plain ints/strings from telemetry or a fleet recommendation, store enums.
        object.__setattr__(self, "backend", _enum(Backend, self.backend))
        object.__setattr__(self, "precision", _enum(Precision, self.precision))
        object.__setattr__(self, "memory", _enum(MemoryMode, self.memory))
        if not isinstance(self.threads, int) or not 1 <= self.threads <= 1024:
            raise ValueError(f"threads must be an int in [1, 1024], not {self.threads!r}")

    @property
    def key(self) -> str:
        """Return the stable string form, e.g. ``"CPU/normal/t2/mem-normal"``."""
        return (
            f"{self.backend.name}/{self.precision.name.lower()}/t{self.threads}"
            f"/mem-{self.memory.name.lower()}"
        )

    @classmethod
    def from_key(cls, key: str) -> BackendConfig:
        """Parse `key` as written by `key`; ValueError names what is wrong."""
        parts = key.split("/")
        if len(parts) != 4 or not parts[2].startswith("t") or not parts[3].startswith("mem-"):
            raise ValueError(f"not a backend config key: {key!r}")
        try:
            threads = int(parts[2][1:])
        except ValueError:
            raise ValueError(f"not a backend config key: {key!r}") from None
        return cls(parts[0], parts[1], threads, parts[3][4:])

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-able dict for telemetry; `from_dict` reverses it."""
        return {
            "backend": self.backend.name,
            "precision": self.precision.name.lower(),
            "threads": self.threads,
            "memory": self.memory.name.lower(),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BackendConfig:
        """Rebuild a config from `to_dict` output."""
        return cls(d["backend"], d["precision"], int(d["threads"]), d["memory"])

    def mnn_session_config(self) -> dict[str, int]:
        """Return the dict ``MNN.Interpreter.createSession`` takes for this config."""
        return {
            "backend": int(self.backend),
            "numThread": self.threads,
            "precision": int(self.precision),
            "memory": int(self.memory),
        }


# The config golden references are computed with: plain fp32 CPU, one thread.
REFERENCE_CONFIG = BackendConfig(Backend.CPU, Precision.HIGH, 1, MemoryMode.NORMAL)
# What runs when nothing was probed or recommended: works everywhere MNN does.
DEFAULT_CONFIG = BackendConfig(Backend.CPU, Precision.NORMAL, 1, MemoryMode.NORMAL)


def candidate_configs(
    *, platform: str | None = None, cpu_count: int | None = None
) -> tuple[BackendConfig, ...]:
    """List the configs worth probing on this device, safest first.

    Accelerators are listed by what the platform can have; whether MNN was built with
    them and the device has a driver is only known by trying, which the probe does (and
    reports a config as unavailable when MNN silently runs it on the CPU instead).
    """
    platform = platform or _platform()
    cpu_count = cpu_count or os.cpu_count() or 1
    threads = sorted({1, max(1, min(_MAX_CPU_THREADS, cpu_count))})
    configs = [
        BackendConfig(Backend.CPU, precision, n)
        for n in threads
        for precision in (Precision.NORMAL, Precision.LOW)
    ]
    for backend in _ACCELERATORS.get(platform, ()):
        for precision in (Precision.NORMAL, Precision.LOW):
            configs.append(BackendConfig(backend, precision, GPU_MODE))
    return tuple(configs)


_ACCELERATORS: dict[str, tuple[Backend, ...]] = {
    "linux": (Backend.OPENCL, Backend.VULKAN, Backend.CUDA),
    "android": (Backend.OPENCL, Backend.VULKAN, Backend.NN),
    "darwin": (Backend.METAL, Backend.NN),
    "ios": (Backend.METAL, Backend.NN),
}


def _platform() -> str:
    """Return "android", "ios", "darwin", "linux" or whatever else sys.platform says."""
    if sys.platform == "linux" and hasattr(sys, "getandroidapilevel"):
        return "android"  # CPython before 3.13 reports Android as linux
    return sys.platform
