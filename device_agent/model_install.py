"""The self-test of a version (not a language model): load, golden check, backend probe.

The version is loaded in a crash-contained worker (runtime.Model, `isolation="worker"`)
and checked against its golden inputs and outputs on the backend configs this device can
run; the fastest config that reproduces them serves. Two shortcuts skip the probe of every
candidate: the assignment's `recommended_config` (the fleet's pick for the device's class)
is loaded first, and a new version of a model the device already serves (`promote`) loads
on the config its previous version won with, serves as soon as that passes, and leaves
the other candidates to be probed while it serves (`pending`: runtime.Model.probe_others).
A config that fails the golden check here falls back to the full probe.

Language models have their own (device_agent.llm_install).
"""

from __future__ import annotations

from contract.assignment import VerifiedModel
from device_agent.plaintext import Plaintext
from device_agent.state import AgentError, SelfTestFailed, one_line

__all__ = ["probe_json", "self_test"]


def self_test(
    m: VerifiedModel,
    source: Plaintext,
    golden_npz: bytes | None,
    previous_config: str = "",
    *,
    promote: bool = False,
) -> tuple:
    """Load `m` from `source` in a worker, probing configs against its golden data.

    Returns (the loaded runtime.Model, its config key, the probe summaries, whether the
    other candidates are still to probe). SelfTestFailed when the version cannot serve
    here; AgentError when the machine, not the version, interrupted it (tried again).
    """
    # Deferred: `skiff agent status` never needs the runtime.
    from runtime import (
        DeadlineExceeded,
        Golden,
        Model,
        ModelFailed,
        ModelLoadError,
        RuntimeFailure,
        WorkerCrashed,
    )

    plain = source.read()
    version = f"{m.model}:{m.version}"
    try:
        golden = None
        if golden_npz is not None:
            golden = Golden.from_npz(golden_npz).for_variant(m.variant)
        model, tried, pending = None, None, False
        first = _recommended(m.recommended_config) if golden is not None else None
        if first is not None:
            tried = first.key
        elif golden is not None and promote:
            # It serves as soon as it loads: the rest is probed while it does.
            first = _recommended(previous_config)
            pending = first is not None
        if first is not None:
            # One load and golden check instead of a probe of every candidate. If it
            # fails the check here, probe as usual.
            model = _load_on(first, plain, golden, version)
            pending = pending and model is not None
        if model is None:
            model = Model.from_bytes(plain, golden=golden, isolation="worker", version=version)
    except (DeadlineExceeded, WorkerCrashed) as exc:
        # The machine, not the version: a busy or memory-starved device. Tried again.
        raise AgentError(f"self-test interrupted: {one_line(exc)}") from None
    except (ModelFailed, ModelLoadError, RuntimeFailure, ValueError) as exc:
        raise SelfTestFailed(f"self-test failed: {one_line(exc)}") from None
    finally:
        del plain
    if m.pipeline is not None:
        from runtime.pipeline import Pipeline, PipelineError

        try:  # built once here so a version whose pipeline cannot run never activates
            Pipeline.for_model(m.pipeline, model.signature)
        except (PipelineError, ValueError) as exc:
            model.close()
            raise SelfTestFailed(f"self-test failed: pipeline: {one_line(exc)}") from None
    config = model.config.key if model.config is not None else ""
    probes = [probe_json(p) for p in model.probe_results]
    for probe in probes:
        probe["recommended"] = probe.get("config") == tried
    return model, config, probes, pending


def _load_on(config, plain: bytes, golden, version: str):
    """Load on `config` alone; return the model if that config passed the golden check.

    None: it did not (nor, perhaps, the CPU default behind it), so the caller probes.
    """
    from runtime import Model, ModelFailed

    try:
        model = Model.from_bytes(
            plain, golden=golden, config=config, isolation="worker", version=version
        )
    except ModelFailed:
        return None
    if model.config != config:  # it failed here: the CPU default took over
        model.close()
        return None
    return model


def _recommended(key: str):
    """Return the config named by `key` if this device can run it (else None: probe)."""
    from runtime import BackendConfig, candidate_configs

    if not key:
        return None
    try:
        config = BackendConfig.from_key(key)
    except (ValueError, KeyError):
        return None  # a config this agent does not know: the probe decides
    return config if config in candidate_configs() else None


def probe_json(p) -> dict:
    """Return a probe result as a pointer and status keep it (no raw samples)."""
    body = p.to_dict()
    body.pop("samples_us", None)  # the summary is enough for status and reports
    return body
