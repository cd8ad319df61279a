"""Installing a language model: its bundle into sealed memfds, a worker, a self-test.

A language model's artifact is its MNN-LLM bundle as one canonical tar, encrypted like
any artifact. It is decrypted segment by segment straight into one sealed memfd per
bundle file (`runtime.llm.read_bundle_tar`), never whole into memory and never onto a
disk, and checked against its signed digest before anything loads it. MNN-LLM then runs
in a crash-contained worker (`runtime.llm.LlmWorker`).

The self-test replays the version's golden prompts: teacher-forced on the reference's
continuations, this device's top-1 agreement must come within `AGREEMENT_SLACK` of what
the registry measured for the variant (thread counts and CPU kernels differ between
machines, so close choices may flip; a broken bundle or engine agrees at chance).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

from contract.assignment import VerifiedModel
from contract.envelope import decrypt_stream
from device_agent.download import IntegrityFailure
from device_agent.state import AgentError, SelfTestFailed, one_line

__all__ = ["AGREEMENT_SLACK", "load_bundle", "self_test", "threads"]

# How far below the registry's figure this device's agreement may fall.
AGREEMENT_SLACK = 0.1
MAX_GOLDEN_BYTES = 8 << 20


def threads() -> int:
    """Return the threads MNN-LLM gets: the cores this process may use, at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def load_bundle(
    path: Path, key: bytes, associated_data: bytes, plaintext_sha256: str, plaintext_size: int
):
    """Decrypt an installed bundle into memfds and load it in a worker; return the worker."""
    from runtime.llm import LlmWorker, close_files

    files = _decrypt_bundle(path, key, associated_data, plaintext_sha256, plaintext_size)
    try:
        return LlmWorker(files, threads=threads())
    finally:
        close_files(files)  # the worker keeps its own copies of the descriptors


def self_test(m: VerifiedModel, path: Path, key: bytes, golden: bytes | None):
    """Load the assigned bundle and check it on the golden prompts; return the worker.

    SelfTestFailed: the bundle is malformed, does not load, or disagrees with the
    reference; AgentError: the machine interrupted it (a crash or deadline: tried again).
    """
    from runtime import DeadlineExceeded, RuntimeFailure, WorkerCrashed

    try:
        worker = load_bundle(path, key, m.associated_data, m.plaintext_sha256, m.plaintext_size)
    except (DeadlineExceeded, WorkerCrashed) as exc:
        raise AgentError(f"self-test interrupted: {one_line(exc)}") from None
    except (RuntimeFailure, ValueError) as exc:
        raise SelfTestFailed(f"self-test failed: {one_line(exc)}") from None
    try:
        if golden is not None:
            _check_golden(worker, m.variant, golden)
    except (DeadlineExceeded, WorkerCrashed) as exc:
        worker.close()
        raise AgentError(f"self-test interrupted: {one_line(exc)}") from None
    except (RuntimeFailure, ValueError, KeyError, TypeError) as exc:
        worker.close()
        raise SelfTestFailed(f"self-test failed: {one_line(exc)}") from None
    except BaseException:
        worker.close()
        raise
    return worker


def _check_golden(worker, variant: str, golden: bytes) -> None:
    """Teacher-force the golden prompts; refuse a bundle that agrees less than it should."""
    import numpy as np

    if len(golden) > MAX_GOLDEN_BYTES:
        raise SelfTestFailed(f"self-test failed: golden data of {len(golden):,} bytes")
    data = json.loads(golden)
    expected = float(data["variants"][variant]["top1_agreement"])
    hits = total = 0
    for prompt in data["prompts"]:
        ids, continuation = list(prompt["ids"]), list(prompt["reference"])
        if not continuation:
            continue
        logits = worker.logits(ids, continuation)
        hits += int(np.sum(np.argmax(logits, axis=-1) == np.asarray(continuation)))
        total += len(continuation)
    if total == 0:
        raise SelfTestFailed("self-test failed: the golden data holds no continuation")
    agreement = hits / total
    if agreement < expected - AGREEMENT_SLACK:
        raise SelfTestFailed(
            f"self-test failed: top-1 agreement with the reference {agreement:.3f} on this "
            f"device, the registry measured {expected:.3f} for {variant}"
        )


def _decrypt_bundle(
    path: Path, key: bytes, associated_data: bytes, plaintext_sha256: str, plaintext_size: int
) -> dict[str, int]:
    """Decrypt the bundle tar straight into sealed memfds, checked against its digest."""
    from runtime.llm import InvalidBundle, close_files, read_bundle_tar

    digest, size = hashlib.sha256(), 0

    def plaintext() -> Iterator[bytes]:
        nonlocal size
        with open(path, "rb") as f:
            for chunk in decrypt_stream(key, f, associated_data=associated_data):
                size += len(chunk)
                if size > plaintext_size:
                    raise IntegrityFailure(f"artifact {path.name[:12]}: longer than signed")
                digest.update(chunk)
                yield chunk

    chunks = plaintext()
    files: dict[str, int] = {}
    try:
        files = read_bundle_tar(chunks)
        for _ in chunks:  # the tar's end padding: every byte counts toward the digest
            pass
        if size != plaintext_size or digest.hexdigest() != plaintext_sha256:
            raise IntegrityFailure(
                f"artifact {path.name[:12]}: plaintext does not match its digest"
            )
    except IntegrityFailure:
        close_files(files)
        raise
    except InvalidBundle as exc:
        raise SelfTestFailed(f"self-test failed: {one_line(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - Tink raises its own errors for bad segments
        close_files(files)
        raise IntegrityFailure(f"artifact {path.name[:12]} does not decrypt: {exc}") from None
    return files
