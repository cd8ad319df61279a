"""Telemetry messages to records and back; every field a device sends is checked here.

A device's report is its own word about itself, stored and later rolled up: each field
is bounded so one device cannot bloat the database or break a rollup.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
import re

from contract import errors
from contract.limits import check_text
from control_plane.api.fleet_convert import timestamp
from control_plane.registry.requests import MAX_VERSION, VARIANT_NAME, validate_name
from control_plane.store.report_records import (
    INSTALL_RESULTS,
    MAX_REPORT_AGE,
    InstallRecord,
    ModelStatsRecord,
    ReportBatch,
)
from control_plane.telemetry.reports import DeviceLatency
from protos import device_pb2, fleet_pb2
from runtime.backends import BackendConfig
from runtime.histogram import N_BUCKETS, SCHEME, bucket_of

BATCH_ID = re.compile(r"[A-Za-z0-9_-]{8,64}")
MAX_MODEL_STATS = 256
MAX_INSTALLS = 256
MAX_EVENTS = 64  # crashes or fallbacks per model stats entry
MAX_PROBES = 32
MAX_TEXT = 1000  # reasons and crash details
# A device clock may run ahead a little; a period ending further in the future is refused,
# and so is anything older than the queue a device keeps (7 days) with a margin.
CLOCK_SKEW = dt.timedelta(hours=1)
MAX_AGE = MAX_REPORT_AGE
# Counts per batch: summed over many batches they must still fit int64 (fleet show).
MAX_COUNT = 1 << 40
MAX_DROPPED = 2**31 - 1
INT64_MAX = 2**63 - 1


MAX_THREADS = 256
# A language model's tokens per generation, prompt or output: MNN-LLM's context bound.
MAX_TOKENS_PER_GENERATION = 1 << 20
MAX_CLOCK_OFFSET_S = 100 * 365 * 86_400.0  # a clock a century off is no clock


def _config(value: str, what: str) -> str:
    """Check a backend config key (runtime.BackendConfig.key); "" is allowed (none).

    Only canonical keys: rollups keep a row per config, so a device must not be able to
    invent endless spellings of one.
    """
    if value and not _is_config_key(value):
        raise errors.InvalidArgument(f"{what} {value!r:.80} is not a backend config key")
    return value


@functools.lru_cache(maxsize=1024)  # a fleet reports a handful of configs, over and over
def _is_config_key(value: str) -> bool:
    try:
        config = BackendConfig.from_key(value)
    except (ValueError, KeyError):
        return False
    return config.key == value and 1 <= config.threads <= MAX_THREADS


def _text(value: str, what: str, limit: int = MAX_TEXT) -> str:
    # Control characters (ESC above all) would reach operators' terminals via fleet show.
    return check_text(what, value, limit, multiline=True)


def _count(value: int, what: str, limit: int = MAX_COUNT) -> int:
    if not 0 <= value <= limit:
        raise errors.InvalidArgument(f"{what} must be between 0 and {limit}, not {value}")
    return value


def _seconds(value: float, what: str) -> float:
    if not math.isfinite(value) or value < 0:
        raise errors.InvalidArgument(f"{what} must be a finite number >= 0, not {value}")
    return value


def _when(ts, what: str, now: dt.datetime) -> dt.datetime:
    if not ts.seconds and not ts.nanos:
        raise errors.InvalidArgument(f"{what} is not set")
    try:
        value = ts.ToDatetime(tzinfo=dt.UTC)
    except (ValueError, OverflowError):
        raise errors.InvalidArgument(f"{what} is not a valid time") from None
    if value > now + CLOCK_SKEW:
        raise errors.InvalidArgument(f"{what} {value.isoformat()} is in the future")
    if value < now - MAX_AGE:
        raise errors.InvalidArgument(f"{what} {value.isoformat()} is more than 30 days old")
    return value


def _version(model: str, version: int, variant: str, what: str) -> None:
    validate_name(model)
    if not 1 <= version <= MAX_VERSION:
        raise errors.InvalidArgument(f"{what} {model}: version {version} out of range")
    if not VARIANT_NAME.fullmatch(variant):
        raise errors.InvalidArgument(f"{what} {model}: invalid variant {variant!r:.40}")


def histogram_dict(msg: device_pb2.LatencyHistogram, what: str) -> dict:
    """Return a histogram message as `LatencyHistogram.to_dict()` data, checked.

    Its buckets are a tuple of pairs (see below): the same JSON, the same pairs to iterate,
    but not equal to a dict read back from JSON, whose buckets are lists.
    """
    # Bounded before anything is built from them: a histogram has N_BUCKETS buckets.
    if len(msg.bucket_index) > N_BUCKETS or len(msg.bucket_count) > N_BUCKETS:
        raise errors.InvalidArgument(f"{what}: more than {N_BUCKETS} buckets")
    if len(msg.bucket_index) != len(msg.bucket_count):
        raise errors.InvalidArgument(f"{what}: bucket_index and bucket_count differ in length")
    if msg.scheme != SCHEME:
        raise errors.InvalidArgument(
            f"{what}: histogram scheme {msg.scheme!r:.80} is not {SCHEME!r}"
        )
    low = _count(msg.min_ns, f"{what} min_ns", 1 << 62) if msg.HasField("min_ns") else None
    high = _count(msg.max_ns, f"{what} max_ns", 1 << 62) if msg.HasField("max_ns") else None
    if low is not None and high is not None and low > high:
        raise errors.InvalidArgument(f"{what}: min_ns is above max_ns")
    count = _count(msg.count, f"{what} count")
    buckets: dict[int, int] = {}
    for index, n in zip(msg.bucket_index, msg.bucket_count, strict=True):
        if not 0 <= index < N_BUCKETS or n < 0:
            raise errors.InvalidArgument(f"{what}: bad histogram bucket [{index}, {n}]")
        if n:
            buckets[index] = buckets.get(index, 0) + n
    if sum(buckets.values()) != count:
        raise errors.InvalidArgument(f"{what}: bucket counts do not add up to its count")
    if count and (low is None or high is None):
        raise errors.InvalidArgument(f"{what}: min_ns and max_ns are required with samples")
    if count and (bucket_of(low) != min(buckets) or bucket_of(high) != max(buckets)):
        # Quantiles are read within the observed range: bounds the buckets do not bear
        # out would let a device place its quantiles anywhere (up to 2**62 ns).
        raise errors.InvalidArgument(
            f"{what}: min_ns and max_ns do not fall in its lowest and highest buckets"
        )
    # Canonical (what LatencyHistogram.to_dict writes): merged duplicates, sorted. The
    # pairs, and the pairs together, are tuples, not lists: a server holds a few seconds
    # of batches for its roller, and the collector stops tracking a tuple of ints (then a
    # tuple of those, then the dict holding them) once it has seen it, where every list
    # stays for it to walk in each full collection (165k of some 200k objects it walked
    # under Report load, once a second; bench/telemetry.py). JSON writes both alike.
    return {
        "scheme": SCHEME,
        "count": count,
        "sum_ns": _count(msg.sum_ns, f"{what} sum_ns", 1 << 62),
        "min_ns": low,
        "max_ns": high,
        "buckets": tuple((i, buckets[i]) for i in sorted(buckets)),
    }


def _stats(msg: device_pb2.ModelStats, now: dt.datetime) -> ModelStatsRecord:
    # How many inferences a period may hold is checked against the server's clock when
    # the batch is stored (control_plane.telemetry.budget), not against what it declares.
    what = f"model stats {msg.model!r:.70}"
    inferences = _count(msg.inferences, f"{what} inferences")
    failed = _count(msg.errors, f"{what} errors")
    latency = histogram_dict(msg.latency, f"{what} latency")
    if failed > inferences or latency["count"] > inferences:
        raise errors.InvalidArgument(f"{what}: more errors or timed samples than inferences")
    ttft = histogram_dict(msg.ttft, f"{what} ttft") if msg.HasField("ttft") else {}
    cancellations = _count(msg.cancellations, f"{what} cancellations")
    if ttft.get("count", 0) > inferences or cancellations > inferences:
        raise errors.InvalidArgument(
            f"{what}: more first tokens timed or generations cancelled than inferences"
        )
    # Tokens come with generations, each at most a context long: a device's budget of
    # inferences (control_plane.telemetry.budget) bounds its tokens too.
    for name in ("tokens_in", "tokens_out"):
        if getattr(msg, name) > inferences * MAX_TOKENS_PER_GENERATION:
            raise errors.InvalidArgument(
                f"{what}: {name} {getattr(msg, name)} for {inferences} generations (at most "
                f"{MAX_TOKENS_PER_GENERATION:,} each)"
            )
    _version(msg.model, msg.version, msg.variant, "model stats")
    if len(msg.crashes) > MAX_EVENTS or len(msg.fallbacks) > MAX_EVENTS:
        raise errors.InvalidArgument(f"{what}: at most {MAX_EVENTS} crashes and fallbacks each")
    crashes = tuple(
        {
            "at": _when(c.at, f"{what} crash time", now).isoformat(),
            "config": _config(c.config, f"{what} crash config"),
            "reason": _text(c.reason, f"{what} crash reason", 16),
            "signal": _text(c.signal, f"{what} crash signal", 16),
            "idle": c.idle,
        }
        for c in msg.crashes
    )
    fallbacks = tuple(
        {
            "at": _when(f.at, f"{what} fallback time", now).isoformat(),
            "from_config": _config(f.from_config, f"{what} fallback config"),
            "to_config": _config(f.to_config, f"{what} fallback config"),
            "reason": _text(f.reason, f"{what} fallback reason"),
        }
        for f in msg.fallbacks
    )
    return ModelStatsRecord(
        model=msg.model,
        version=msg.version,
        variant=msg.variant,
        config=_config(msg.config, f"{what} config"),
        inferences=inferences,
        errors=failed,
        pipeline_firings=_count(msg.pipeline_firings, f"{what} pipeline_firings"),
        latency=latency,
        crashes=crashes,
        fallbacks=fallbacks,
        ttft=ttft,
        tokens_in=_count(msg.tokens_in, f"{what} tokens_in"),
        tokens_out=_count(msg.tokens_out, f"{what} tokens_out"),
        cancellations=cancellations,
    )


def _install(msg: device_pb2.InstallReport, now: dt.datetime) -> InstallRecord:
    what = f"install report {msg.model!r:.70}"
    _version(msg.model, msg.version, msg.variant, "install report")
    if msg.result not in INSTALL_RESULTS:
        raise errors.InvalidArgument(
            f"{what}: result {msg.result!r:.40} is not one of {', '.join(INSTALL_RESULTS)}"
        )
    if len(msg.probes) > MAX_PROBES:
        raise errors.InvalidArgument(f"{what}: at most {MAX_PROBES} probes")
    probes = tuple(
        {
            "config": _config(p.config, f"{what} probe config"),
            "accepted": p.accepted,
            "p50_us": _seconds(p.p50_us, f"{what} probe p50_us"),
            "cosine": p.cosine if math.isfinite(p.cosine) else None,
            "error": _text(p.error, f"{what} probe error"),
        }
        for p in msg.probes
    )
    return InstallRecord(
        at=_when(msg.at, f"{what} time", now),
        model=msg.model,
        version=msg.version,
        variant=msg.variant,
        rollout=_text(msg.rollout, f"{what} rollout", 32),
        result=msg.result,
        reason=_text(msg.reason, f"{what} reason"),
        config=_config(msg.config, f"{what} config"),
        timings={
            "download_s": _seconds(msg.download_s, f"{what} download_s"),
            "verify_s": _seconds(msg.verify_s, f"{what} verify_s"),
            "self_test_s": _seconds(msg.self_test_s, f"{what} self_test_s"),
            "downloaded_bytes": _count(msg.downloaded_bytes, f"{what} downloaded_bytes"),
            "resumed_from": _count(msg.resumed_from, f"{what} resumed_from"),
            "url_bytes": _count(msg.url_bytes, f"{what} url_bytes"),
        },
        probes=probes,
    )


def report_batch(device_id: str, msg: device_pb2.ReportRequest, now: dt.datetime) -> ReportBatch:
    """Check a ReportRequest from `device_id` and return it as a batch to store."""
    if not BATCH_ID.fullmatch(msg.batch_id):
        raise errors.InvalidArgument(
            f"batch_id {msg.batch_id!r:.80} must be 8 to 64 of A-Z a-z 0-9 _ -"
        )
    if len(msg.models) > MAX_MODEL_STATS or len(msg.installs) > MAX_INSTALLS:
        raise errors.InvalidArgument(
            f"a batch holds at most {MAX_MODEL_STATS} model stats and {MAX_INSTALLS} installs"
        )
    start = _when(msg.period_start, "period_start", now)
    end = _when(msg.period_end, "period_end", now)
    if end < start:
        raise errors.InvalidArgument("period_end is before period_start")
    offset = msg.clock_offset_s if msg.HasField("clock_offset_s") else None
    if offset is not None and not (math.isfinite(offset) and abs(offset) <= MAX_CLOCK_OFFSET_S):
        raise errors.InvalidArgument(
            f"clock_offset_s must be a finite number of seconds within ±{MAX_CLOCK_OFFSET_S:g}"
        )
    return ReportBatch(
        clock_offset_s=offset,
        device_id=device_id,
        batch_id=msg.batch_id,
        received_at=now,
        period_start=start,
        period_end=end,
        dropped_batches=_count(msg.dropped_batches, "dropped_batches", MAX_DROPPED),
        models=tuple(_stats(m, now) for m in msg.models),
        installs=tuple(_install(i, now) for i in msg.installs),
    )


def install_pb(i: InstallRecord) -> device_pb2.InstallReport:
    """Return a stored install outcome as its message."""
    t = i.timings
    return device_pb2.InstallReport(
        at=timestamp(i.at),
        model=i.model,
        version=i.version,
        variant=i.variant,
        rollout=i.rollout,
        result=i.result,
        reason=i.reason,
        config=i.config,
        download_s=t.get("download_s", 0.0),
        verify_s=t.get("verify_s", 0.0),
        self_test_s=t.get("self_test_s", 0.0),
        downloaded_bytes=t.get("downloaded_bytes", 0),
        resumed_from=t.get("resumed_from", 0),
        url_bytes=t.get("url_bytes", 0),
        probes=[
            device_pb2.ProbeReport(
                config=p["config"],
                accepted=p["accepted"],
                p50_us=p["p50_us"],
                cosine=p["cosine"] if p["cosine"] is not None else float("nan"),
                error=p["error"],
            )
            for p in i.probes
        ],
    )


def latency_pb(x: DeviceLatency) -> fleet_pb2.DeviceLatency:
    """Return one model version's merged latency as its message."""
    msg = fleet_pb2.DeviceLatency(
        model=x.model,
        version=x.version,
        variant=x.variant,
        config=x.config,
        inferences=min(x.inferences, INT64_MAX),
        errors=min(x.errors, INT64_MAX),
        crashes=min(x.crashes, INT64_MAX),
        since=timestamp(x.since),
        pipeline_firings=min(x.pipeline_firings, INT64_MAX),
    )
    for name, value in x.histogram.percentiles().items():
        if value is not None:
            setattr(msg, name, value)
    return msg
