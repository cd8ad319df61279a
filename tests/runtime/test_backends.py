"""Backend configs: stable keys, telemetry dicts, and the candidates listed per platform."""

from __future__ import annotations

import pytest

from runtime.backends import (
    GPU_MODE,
    Backend,
    BackendConfig,
    MemoryMode,
    Precision,
    candidate_configs,
)


def test_key_and_dict_round_trip():
    config = BackendConfig(Backend.OPENCL, Precision.LOW, 4, MemoryMode.LOW)
    assert config.key == "OPENCL/low/t4/mem-low"
    assert BackendConfig.from_key(config.key) == config
    assert BackendConfig.from_dict(config.to_dict()) == config
    assert str(config.backend) == "OPENCL"


def test_configs_accept_names_and_numbers_from_outside():
    assert BackendConfig("cpu", "high", 2, "normal") == BackendConfig(
        Backend.CPU, Precision.HIGH, 2, MemoryMode.NORMAL
    )
    assert BackendConfig(3).backend is Backend.OPENCL


@pytest.mark.parametrize(
    "bad",
    ["CPU/normal/t1", "GPU/normal/t1/mem-normal", "CPU/normal/tx/mem-normal", "CPU/odd/t1/mem-x"],
)
def test_bad_keys_are_refused(bad):
    with pytest.raises(ValueError):
        BackendConfig.from_key(bad)


def test_thread_count_is_checked():
    with pytest.raises(ValueError, match="threads"):
        BackendConfig(threads=0)


def test_cpu_extension_is_reported_as_cpu():
    # MNN reports 13 (MNN_FORWARD_CPU_EXTENSION) for its AVX2/ARMv8.2 CPU backends.
    assert Backend.from_forward_type(13) is Backend.CPU
    assert Backend.from_forward_type(3) is Backend.OPENCL


def test_candidates_per_platform():
    linux = candidate_configs(platform="linux", cpu_count=8)
    cpus = [c for c in linux if c.backend is Backend.CPU]
    assert {c.threads for c in cpus} == {1, 4}  # capped: more threads only contend
    assert linux[0] == BackendConfig()  # safest first
    assert {c.backend for c in linux} == {Backend.CPU, Backend.OPENCL, Backend.VULKAN, Backend.CUDA}
    assert all(c.threads == GPU_MODE for c in linux if c.backend is not Backend.CPU)
    android = {c.backend for c in candidate_configs(platform="android", cpu_count=8)}
    assert Backend.NN in android and Backend.CUDA not in android
    ios = {c.backend for c in candidate_configs(platform="ios", cpu_count=1)}
    assert ios == {Backend.CPU, Backend.METAL, Backend.NN}
    assert len(set(linux)) == len(linux)
    assert len(candidate_configs(platform="ios", cpu_count=1)) == 2 + 4  # one thread count
