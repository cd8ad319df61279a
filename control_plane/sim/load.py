"""What simulated devices report: serving stats of the models they run, as agents send them.

Every report interval each device sends one `DeviceService.Report` batch per period, like
the agent's report loop: per installed model, the backend config it runs, a latency
histogram (`runtime.LatencyHistogram`, built from drawn samples), inference and error
counts and crash reports. The load is realistic enough for guardrails and backend
choice to have something to see:

* a device runs each model at about `REQUESTS_PER_S` (Poisson);
* its latency is log-normal around a median set by its SoC (a stable draw per SoC),
  its backend config (GPU configs faster) and a per-device factor (a stable draw per
  device), with a spread of `SPREAD` per sample;
* errors and crashes happen at small base rates;
* a language model (its manifest says so) reports generations instead, as the agent
  does (device.proto ModelStats): each generation's decode time per token (log-normal
  around a median set by the SoC's decode speed, `LLM_TPS`, and the same per-device
  factor), its time to first token (the prompt's prefill at `PREFILL_X` times the decode
  speed, plus one token), tokens in and out, and a few cancelled by their caller.

A profile's `inject` rules change that for a slice of the fleet running one version:

    {"inject": [{"select": "soc=sm8450", "model": "ctr:2", "latency_x": 3.0},
                {"select": "device_model~Moto*", "model": "ctr:2", "crash_rate": 0.01}]}

`select` is a fleet selector (`control_plane.fleet.selector`), `model` a NAME:VERSION;
`latency_x` multiplies latency (a language model's time per token and to the first
token), `decode_x` a language model's decode tokens per second (0.6: 40% slower
decoding), `crash_rate` and `error_rate` are per inference. Every rule that matches
applies (factors multiply, rates add).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

from contract import errors
from contract.report_batches import histogram_pb, new_batch_id, timestamp
from control_plane.fleet.selector import Selector, parse_selector
from control_plane.registry.requests import parse_ref
from protos import device_pb2
from runtime.histogram import LatencyHistogram

REQUESTS_PER_S = 2.0
SPREAD = 0.3  # sigma of log(latency) per sample
DEVICE_SPREAD = 0.15  # sigma of log(latency) between devices of one SoC
BASE_ERROR_RATE = 1e-4
BASE_CRASH_RATE = 1e-5
MAX_CRASH_REPORTS = 20  # per model and batch, as the agent caps them
CONFIGS = {"CPU/normal/t4/mem-normal": 1.0, "OPENCL/low/t4/mem-normal": 0.55}
# Language models: MNN-LLM on the CPU, as the agent serves them (its probe's winners: all
# cores, or half of them on phones whose big cores decode faster alone), by speed.
LLM_CONFIGS = {"CPU/low/t4/mem-low": 1.0, "CPU/low/t2/mem-low": 0.8}
LLM_TPS = (15.0, 120.0)  # a SoC's median decode tokens/s for a small model: log-uniform
LLM_SPREAD = 0.08  # sigma of log(time per token) between generations of one device
PREFILL_X = 8.0  # prefill tokens/s over decode tokens/s
LLM_CANCEL_RATE = 0.02
_NORMAL = NormalDist()
_INJECT_KEYS = {"select", "model", "latency_x", "decode_x", "crash_rate", "error_rate"}

__all__ = ["Injection", "Load", "parse_injections"]


@dataclass(frozen=True)
class Injection:
    """A fault a slice of the fleet shows while it runs one model version."""

    selector: Selector
    model: str
    version: int
    latency_x: float = 1.0
    crash_rate: float = 0.0
    error_rate: float = 0.0
    decode_x: float = 1.0

    def applies(self, attributes: Mapping, model: str, version: int) -> bool:
        """Return whether a device with `attributes` running `model:version` shows it."""
        return (model, version) == (self.model, self.version) and self.selector.matches(attributes)


def parse_injections(raw: object) -> tuple[Injection, ...]:
    """Validate a profile's `inject` list; InvalidArgument names the entry and the problem."""
    if not isinstance(raw, Sequence) or isinstance(raw, str):
        raise errors.InvalidArgument("'inject' must be a list of rules")
    out = []
    for i, rule in enumerate(raw):
        where = f"inject[{i}]"
        if not isinstance(rule, Mapping) or not {"select", "model"} <= set(rule):
            raise errors.InvalidArgument(f"{where} must be an object with 'select' and 'model'")
        unknown = sorted(set(rule) - _INJECT_KEYS)
        if unknown:
            raise errors.InvalidArgument(f"{where}: unknown key {', '.join(unknown)}")
        try:
            selector = parse_selector(str(rule["select"]), strict=True)
            model, version = parse_ref(str(rule["model"]))
        except errors.InvalidArgument as exc:
            raise errors.InvalidArgument(f"{where}: {exc}") from None
        if version is None:
            raise errors.InvalidArgument(f"{where}.model must be NAME:VERSION")
        latency_x = _number(rule.get("latency_x", 1.0), f"{where}.latency_x", 0.01, 1000)
        crash = _number(rule.get("crash_rate", 0.0), f"{where}.crash_rate", 0, 1)
        error = _number(rule.get("error_rate", 0.0), f"{where}.error_rate", 0, 1)
        decode_x = _number(rule.get("decode_x", 1.0), f"{where}.decode_x", 0.01, 1000)
        out.append(Injection(selector, model, version, latency_x, crash, error, decode_x))
    return tuple(out)


def _number(value: object, where: str, lo: float, hi: float) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or not lo <= value <= hi:
        raise errors.InvalidArgument(f"{where} must be a number from {lo:g} to {hi:g}")
    return float(value)


def _unit(*parts: object) -> float:
    """Return a stable draw in [0, 1) from its arguments (the same on every run)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


class Load:
    """How one device serves its models: config, typical latency, and what it reports."""

    def __init__(
        self,
        device_id: str,
        attributes: Mapping,
        seed: int,
        requests_per_s: float = REQUESTS_PER_S,
    ) -> None:
        self._attributes = attributes
        self.requests_per_s = requests_per_s
        soc = attributes.get("soc", "unknown")
        # A SoC's median for a small model: 0.5 to 4 ms, log-uniform, stable per SoC.
        self._soc_us = 500 * 8 ** _unit("soc", soc)
        self._device_x = math.exp(DEVICE_SPREAD * _normal(_unit("device", seed, device_id)))
        gpu = attributes.get("platform") == "android" and _unit("gpu", device_id) < 0.6
        self.config = "OPENCL/low/t4/mem-normal" if gpu else "CPU/normal/t4/mem-normal"
        self.llm_config = list(LLM_CONFIGS)[_unit("llm-config", device_id) < 0.3]
        self._rng = np.random.default_rng(int(_unit("rng", seed, device_id) * 2**63))

    def median_us(self, model: str, version: int, injections: Sequence[Injection]) -> float:
        """Return this device's median latency for `model:version` (injections applied)."""
        x = math.prod(
            i.latency_x for i in injections if i.applies(self._attributes, model, version)
        )
        model_x = 0.5 + 2 * _unit("model", model)  # models differ in size
        return self._soc_us * self._device_x * CONFIGS[self.config] * model_x * x

    def decode_tps(self, model: str, version: int, injections: Sequence[Injection]) -> float:
        """Return this device's median decode tokens/s for a language model's version."""
        hits = [i for i in injections if i.applies(self._attributes, model, version)]
        low, high = LLM_TPS
        soc_tps = low * (high / low) ** _unit("soc-tps", self._attributes.get("soc", "unknown"))
        x = math.prod(i.decode_x for i in hits) / math.prod(i.latency_x for i in hits)
        return soc_tps / self._device_x * LLM_CONFIGS[self.llm_config] * x

    def batch(
        self,
        installed: Mapping[str, tuple[int, str]],
        start: dt.datetime,
        end: dt.datetime,
        injections: Sequence[Injection],
        llm: frozenset[str] | set[str] = frozenset(),
    ) -> device_pb2.ReportRequest | None:
        """Return the batch this device reports for [start, end), or None if idle.

        Models named in `llm` are language models (they report generations).
        """
        seconds = (end - start).total_seconds()
        batch = device_pb2.ReportRequest(
            batch_id=new_batch_id(), period_start=timestamp(start), period_end=timestamp(end)
        )
        for model, (version, variant) in sorted(installed.items()):
            n = int(self._rng.poisson(self.requests_per_s * seconds))
            if n == 0:
                continue
            hits = [i for i in injections if i.applies(self._attributes, model, version)]
            error_rate = min(1.0, BASE_ERROR_RATE + sum(i.error_rate for i in hits))
            crash_rate = min(1.0, BASE_CRASH_RATE + sum(i.crash_rate for i in hits))
            errors_n = int(self._rng.binomial(n, error_rate))
            crashes_n = int(self._rng.binomial(n, crash_rate))
            if model in llm:
                stats = self._generations(model, version, variant, n, errors_n, hits, injections)
            else:
                median = self.median_us(model, version, injections)
                samples = LatencyHistogram()
                samples.record_many_ns(
                    self._rng.lognormal(math.log(median * 1000), SPREAD, n - errors_n).astype(
                        np.int64
                    )
                )
                stats = device_pb2.ModelStats(
                    model=model,
                    version=version,
                    variant=variant,
                    config=self.config,
                    latency=histogram_pb(samples),
                    inferences=n,
                    errors=errors_n,
                )
            for k in range(min(crashes_n, MAX_CRASH_REPORTS)):
                at = start + (end - start) * ((k + 1) / (crashes_n + 1))
                stats.crashes.append(
                    device_pb2.CrashReport(
                        at=timestamp(at),
                        config=stats.config,
                        reason="simulated crash",
                        signal="SIGSEGV",
                    )
                )
            batch.models.append(stats)
        return batch if batch.models else None

    def _generations(self, model, version, variant, n, errors_n, hits, injections):
        """Return a language model's stats: `n` generations, `errors_n` of them failed."""
        rng, ok = self._rng, n - errors_n
        tps = self.decode_tps(model, version, injections)
        tokens_in = 16 + rng.poisson(40, ok)
        tokens_out = 1 + rng.poisson(60, ok)
        token_ns = rng.lognormal(math.log(1e9 / tps), LLM_SPREAD, ok)
        # Prefill runs at its own speed: `decode_x` slows decoding alone.
        prefill_tps = tps * PREFILL_X / math.prod(i.decode_x for i in hits)
        ttft_ns = (tokens_in * 1e9 / prefill_tps + token_ns) * rng.lognormal(0, LLM_SPREAD, ok)
        decode, ttft = LatencyHistogram(), LatencyHistogram()
        decode.record_many_ns(token_ns[tokens_out > 1].astype(np.int64))
        ttft.record_many_ns(ttft_ns.astype(np.int64))
        return device_pb2.ModelStats(
            model=model,
            version=version,
            variant=variant,
            config=self.llm_config,
            latency=histogram_pb(decode),
            ttft=histogram_pb(ttft),
            inferences=n,
            errors=errors_n,
            tokens_in=int(tokens_in.sum()),
            tokens_out=int(tokens_out.sum()),
            cancellations=int(rng.binomial(ok, LLM_CANCEL_RATE)),
        )


def _normal(u: float) -> float:
    """Return the standard normal deviate of a uniform one (the inverse CDF)."""
    return _NORMAL.inv_cdf(min(max(u, 1e-12), 1 - 1e-12))
