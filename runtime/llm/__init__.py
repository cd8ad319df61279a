"""On-device language models: MNN-LLM bundles, token-by-token generation, scoring.

`runtime.llm.bundle` reads a bundle tar into sealed memfds and validates it;
`runtime.llm.session.LlmSession` loads it with MNN-LLM and streams text deltas;
`runtime.llm.worker.LlmWorker` serves a session from a child process that may crash;
`runtime.llm.scoring.score` compares a candidate's teacher-forced logits with a
reference's. Like `runtime` itself, this package imports nothing of Skiff, and importing
it loads neither numpy nor MNN: each name comes from its module on first use (PEP 562).
"""

from __future__ import annotations

import importlib

TYPE_CHECKING = False
if TYPE_CHECKING:
    from runtime.llm.bundle import (
        BundleDir,
        BundleInfo,
        InvalidBundle,
        close_files,
        read_bundle_tar,
        validate_bundle,
        write_bundle_tar,
    )
    from runtime.llm.scoring import Agreement, score
    from runtime.llm.session import Delta, LlmSession, Sampling, StopReason, Summary
    from runtime.llm.worker import LlmWorker

_EXPORTS = {
    "BundleDir": "runtime.llm.bundle",
    "BundleInfo": "runtime.llm.bundle",
    "InvalidBundle": "runtime.llm.bundle",
    "close_files": "runtime.llm.bundle",
    "read_bundle_tar": "runtime.llm.bundle",
    "validate_bundle": "runtime.llm.bundle",
    "write_bundle_tar": "runtime.llm.bundle",
    "Agreement": "runtime.llm.scoring",
    "score": "runtime.llm.scoring",
    "Delta": "runtime.llm.session",
    "LlmSession": "runtime.llm.session",
    "Sampling": "runtime.llm.session",
    "StopReason": "runtime.llm.session",
    "Summary": "runtime.llm.session",
    "LlmWorker": "runtime.llm.worker",
}

__all__ = [
    "Agreement",
    "BundleDir",
    "BundleInfo",
    "Delta",
    "InvalidBundle",
    "LlmSession",
    "LlmWorker",
    "Sampling",
    "StopReason",
    "Summary",
    "close_files",
    "read_bundle_tar",
    "score",
    "validate_bundle",
    "write_bundle_tar",
]


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime.llm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
