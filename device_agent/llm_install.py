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

It is also the backend probe. MNN-LLM runs on the CPU; what varies is its threads and its
memory mode (`low` quantizes activations to int8 on the fly: 3-4x faster than `normal`,
and less exact). Each candidate config (`candidates`) is loaded and checked on the golden
prompts (agreement first), then timed decoding (`PROBE_TOKENS` greedy tokens): the
fastest that agrees serves. The fleet's pick for the device's class (the assignment's
`recommended_config`, ranked by decode tokens per second from the fleet's telemetry) is
tried first, and served without probing the rest when it agrees here. mmap is never a
candidate: MNN-LLM would map the weights from a file, and the plaintext has no file.
"""

from __future__ import annotations

import json
import os

from contract.assignment import VerifiedModel
from device_agent.download import IntegrityFailure
from device_agent.plaintext import Plaintext
from device_agent.state import AgentError, SelfTestFailed, one_line

__all__ = ["AGREEMENT_SLACK", "PROBE_TOKENS", "candidates", "load_bundle", "self_test", "threads"]

# How far below the registry's figure this device's agreement may fall.
AGREEMENT_SLACK = 0.1
MAX_GOLDEN_BYTES = 8 << 20
# Greedy tokens a probe decodes to time a config.
PROBE_TOKENS = 16


def threads() -> int:
    """Return the threads MNN-LLM gets: the cores this process may use, at most 4."""
    return max(1, min(4, len(os.sched_getaffinity(0))))


def candidates(recommended: str = "") -> list:
    """Return the configs a probe tries, in order (runtime.BackendConfig).

    The fleet's pick first when this device can run it (a CPU config within its cores);
    then all cores with `memory: low`, all cores with `normal`, half the cores with `low`
    (big.LITTLE phones often decode faster on their big cores alone).
    """
    from runtime import Backend, BackendConfig

    n = threads()
    found = [
        BackendConfig(Backend.CPU, "low", n, "low"),
        BackendConfig(Backend.CPU, "low", n, "normal"),
        BackendConfig(Backend.CPU, "low", max(1, n // 2), "low"),
    ]
    try:
        pick = BackendConfig.from_key(recommended) if recommended else None
    except (ValueError, KeyError):
        pick = None  # a config this agent does not know: the probe decides
    if pick is not None and pick.backend == Backend.CPU and 1 <= pick.threads <= n:
        found.insert(0, pick)
    unique: list = []
    for config in found:
        if config not in unique:
            unique.append(config)
    return unique


def load_bundle(source: Plaintext, config: str = ""):
    """Decrypt an installed bundle into memfds and load it in a worker; return the worker.

    On `config` (a BackendConfig key: what the self-test chose), else the first candidate.
    """
    from runtime import BackendConfig

    chosen = candidates()[0]
    if config:
        try:
            chosen = BackendConfig.from_key(config)
        except (ValueError, KeyError):
            pass  # an older slot's config: the default serves
    files = _decrypt_bundle(source)
    try:
        return _worker(files, chosen)
    finally:
        from runtime.llm import close_files

        close_files(files)  # the worker keeps its own copies of the descriptors


def _worker(files, config):
    from runtime.llm import LlmWorker

    return LlmWorker(
        files,
        threads=config.threads,
        precision=config.precision.name.lower(),
        memory=config.memory.name.lower(),
    )


def self_test(m: VerifiedModel, source: Plaintext, golden: bytes | None):
    """Load the assigned bundle, probe its configs on the golden prompts; return the best.

    Returns (the worker on the config that serves, the probes as JSON-able dicts: config,
    accepted, p50_us = decode time per token, cosine = top-1 agreement, error).
    SelfTestFailed: the bundle is malformed or no config loads and agrees with the
    reference; AgentError: every config that failed was interrupted by the machine (a
    crash or deadline: tried again later).
    """
    from runtime.llm import close_files

    files = _decrypt_bundle(source)
    data = _golden(golden) if golden is not None else None
    try:
        return _probe(files, m, data)
    finally:
        close_files(files)


def _probe(files, m: VerifiedModel, data: dict | None):
    from runtime import DeadlineExceeded, RuntimeFailure, WorkerCrashed

    order = candidates(m.recommended_config)
    if data is None:
        order = order[:1]  # nothing to check or time against: the default serves
    best, best_tps, probes, interrupted = None, 0.0, [], False
    for config in order:
        probe = {"config": config.key, "accepted": False, "p50_us": None, "cosine": None}
        probe["recommended"] = config.key == m.recommended_config
        probes.append(probe)
        worker = None
        try:
            worker = _worker(files, config)
            if data is not None:
                probe["cosine"] = agreement = _agreement(worker, data)
                expected = float(data["variants"][m.variant]["top1_agreement"])
                if agreement < expected - AGREEMENT_SLACK:
                    probe["error"] = (
                        f"top-1 agreement with the reference {agreement:.3f} on this device, "
                        f"the registry measured {expected:.3f} for {m.variant}"
                    )
                    continue
                tps = _decode_tps(worker, data)
                probe["p50_us"] = 1e6 / tps if tps > 0 else None
            else:
                tps = 0.0
            probe["accepted"] = True
            if best is None or tps > best_tps:
                best, worker, best_tps = worker, best, tps
            if probe["recommended"]:
                break  # the fleet's pick agrees here: it serves, no more probing
        except (DeadlineExceeded, WorkerCrashed) as exc:
            probe["error"] = one_line(exc)
            interrupted = True
        except (RuntimeFailure, ValueError, KeyError, TypeError) as exc:
            probe["error"] = one_line(exc)
        finally:
            if worker is not None:
                worker.close()
    if best is None:
        why = "; ".join(f"{p['config']}: {p.get('error')}" for p in probes)
        if interrupted:
            raise AgentError(f"self-test interrupted: {why}")
        raise SelfTestFailed(f"self-test failed: {why}")
    return best, probes


def _golden(golden: bytes) -> dict:
    if len(golden) > MAX_GOLDEN_BYTES:
        raise SelfTestFailed(f"self-test failed: golden data of {len(golden):,} bytes")
    try:
        data = json.loads(golden)
        prompts = [(list(p["ids"]), list(p["reference"])) for p in data["prompts"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SelfTestFailed(f"self-test failed: golden data: {one_line(exc)}") from None
    if not any(continuation for _, continuation in prompts):
        raise SelfTestFailed("self-test failed: the golden data holds no continuation")
    return data


def _agreement(worker, data: dict) -> float:
    """Teacher-force the golden prompts; return the share of positions whose top-1 agrees."""
    import numpy as np

    hits = total = 0
    for prompt in data["prompts"]:
        ids, continuation = list(prompt["ids"]), list(prompt["reference"])
        if not continuation:
            continue
        logits = worker.logits(ids, continuation)
        hits += int(np.sum(np.argmax(logits, axis=-1) == np.asarray(continuation)))
        total += len(continuation)
    return hits / total


def _decode_tps(worker, data: dict) -> float:
    """Decode `PROBE_TOKENS` greedy tokens after the first golden prompt; return tokens/s."""
    from runtime.llm import Sampling

    ids = list(data["prompts"][0]["ids"])
    summary = None
    for delta in worker.generate(ids, max_new_tokens=PROBE_TOKENS, sampling=Sampling()):
        summary = delta.summary or summary
    return summary.decode_tps if summary is not None else 0.0


def _decrypt_bundle(source: Plaintext) -> dict[str, int]:
    """Decrypt the bundle tar straight into sealed memfds, checked against its digest."""
    from runtime.llm import InvalidBundle, close_files, read_bundle_tar

    chunks = source.checked()  # IntegrityFailure for bad bytes, checked to the last one
    files: dict[str, int] = {}
    try:
        files = read_bundle_tar(chunks)
        for _ in chunks:  # the tar's end padding: every byte counts toward the digest
            pass
    except IntegrityFailure:
        close_files(files)
        raise
    except InvalidBundle as exc:
        raise SelfTestFailed(f"self-test failed: {one_line(exc)}") from None
    return files
