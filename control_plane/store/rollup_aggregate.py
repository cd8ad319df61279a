"""The mergeable aggregate a rollup row holds, and what a report entry adds to one.

Every field adds up exactly across rows: counters, crash signals and latency histograms
(the same fixed buckets as `runtime.histogram`, kept dense here, sparse in a stored row
as `encode_buckets` writes them), so any window or grouping is a merge of rows.
"""

from __future__ import annotations

import collections
import math
import signal
from dataclasses import dataclass, field

import numpy as np

from control_plane.store.report_records import InstallRecord, ModelStatsRecord
from runtime.histogram import N_BUCKETS, SCHEME, bucket_estimate_ns

COUNTERS = (
    "inferences",
    "errors",
    "crashes",
    "fallbacks",
    "pipeline_firings",
    "installs_activated",
    "installs_failed",
    "installs_rolled_back",
    # Language models (device.proto ModelStats): tokens prefilled and generated, and
    # generations their caller cancelled.
    "tokens_in",
    "tokens_out",
    "cancellations",
)
INSTALL_COUNTERS = ("installs_activated", "installs_failed", "installs_rolled_back")
_INSTALL_COUNTER = {
    "activated": "installs_activated",
    "failed": "installs_failed",
    "rolled_back": "installs_rolled_back",
}


INT64_MAX = 2**63 - 1
# What a crash is counted as: its signal if it was killed by one, else the runtime's reason
# (runtime.events.CrashEvent); anything else a device sends is "other", so one device
# cannot grow a rollup row with made-up names.
_SIGNALS = frozenset(s.name for s in signal.Signals)
_REASONS = frozenset({"signal", "exit", "deadline", "protocol"})


def crash_kind(crash: dict) -> str:
    """Return the name a crash is counted under (a bounded set)."""
    name = crash.get("signal") or ""
    if name in _SIGNALS:
        return name
    reason = crash.get("reason") or ""
    return reason if reason in _REASONS else "other"


def saturating_add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Add non-negative int64 counts, sticking at INT64_MAX instead of wrapping around.

    Counts come from devices: however many report however much, a rollup must not wrap
    into negative numbers (nor fail to store in a BIGINT column).
    """
    if a.dtype != np.int64 or b.dtype != np.int64:
        return a + b  # float accumulators (reads) do not wrap
    out = a + b
    wrapped = out < a
    if wrapped.any():
        out[wrapped] = INT64_MAX
    return out


def clamp(value: int) -> int:
    """Return `value` capped at what a BIGINT column holds."""
    return min(value, INT64_MAX)


def encode_buckets(counts: np.ndarray) -> bytes:
    """Return histogram bucket counts as sparse bytes: uint16 indexes, then int64 counts."""
    index = np.flatnonzero(counts)
    return index.astype("<u2").tobytes() + counts[index].astype("<i8").tobytes()


def decode_buckets(blob: bytes) -> tuple[np.ndarray, np.ndarray]:
    """Return (indexes, counts) of sparse bytes written by `encode_buckets`."""
    n = len(blob) // 10
    if n * 10 != len(blob):
        raise ValueError("sparse histogram of a wrong length")
    return np.frombuffer(blob, "<u2", n), np.frombuffer(blob, "<i8", n, offset=2 * n)


@dataclass(slots=True)  # not frozen: made for every report entry, and never changed
class ParsedHistogram:
    """A reported histogram as arrays: parsed once, added to every aggregate it counts in."""

    index: np.ndarray  # bucket indexes (intp), unique
    count: np.ndarray  # their counts (int64)
    n: int
    sum_ns: int
    min_ns: int | None
    max_ns: int | None

    @classmethod
    def of(cls, h: dict) -> ParsedHistogram | None:
        """Return `h` (runtime.LatencyHistogram.to_dict() data) parsed; None when empty."""
        if h.get("scheme") != SCHEME or not h.get("count"):
            return None
        pairs = h["buckets"]  # canonical: unique indexes, each count below 2**40
        index = np.fromiter((i for i, _ in pairs), np.intp, len(pairs))
        count = np.fromiter((n for _, n in pairs), np.int64, len(pairs))
        return cls(index, count, h["count"], h["sum_ns"], h["min_ns"], h["max_ns"])


@dataclass(slots=True)  # not frozen: made for every report entry, and never changed
class StatsDelta:
    """What one model stats entry adds to an aggregate, worked out once.

    A report counts in several aggregates (each resolution, the fleet's and each rollout's
    rows, the device's own): parsing its histograms and naming its crashes once, not per
    aggregate, was most of the roller's time.
    """

    inferences: int
    errors: int
    crashes: int
    fallbacks: int
    pipeline_firings: int
    tokens_in: int
    tokens_out: int
    cancellations: int
    crash_kinds: tuple[str, ...]  # each crash's name (crash_kind)
    latency: ParsedHistogram | None
    ttft: ParsedHistogram | None

    @classmethod
    def of(cls, s: ModelStatsRecord) -> StatsDelta:
        """Return what `s` adds."""
        return cls(
            s.inferences,
            s.errors,
            len(s.crashes),
            len(s.fallbacks),
            s.pipeline_firings,
            s.tokens_in,
            s.tokens_out,
            s.cancellations,
            tuple(crash_kind(c) for c in s.crashes),
            ParsedHistogram.of(s.latency),
            ParsedHistogram.of(s.ttft) if s.ttft else None,
        )


@dataclass
class Aggregate:
    """Counters, crash signals and a latency histogram of some devices over some time.

    For a language model, the latency histogram is decode time per token, and `ttft`
    holds time to first token: an aggregate of its own that holds only that histogram
    (None until a first token is timed), so every quantile reading applies to it as is.
    """

    inferences: int = 0
    errors: int = 0
    crashes: int = 0
    fallbacks: int = 0
    pipeline_firings: int = 0
    installs_activated: int = 0
    installs_failed: int = 0
    installs_rolled_back: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cancellations: int = 0
    crash_signals: collections.Counter = field(default_factory=collections.Counter)
    buckets: np.ndarray = field(default_factory=lambda: np.zeros(N_BUCKETS, np.int64))
    latency_count: int = 0
    latency_sum_ns: int = 0
    latency_min_ns: int | None = None
    latency_max_ns: int | None = None
    ttft: Aggregate | None = None

    def add_stats(self, s: ModelStatsRecord | StatsDelta) -> None:
        """Add one model stats entry of a telemetry batch (or its `StatsDelta`)."""
        d = s if isinstance(s, StatsDelta) else StatsDelta.of(s)
        self.inferences += d.inferences
        self.errors += d.errors
        self.crashes += d.crashes
        self.fallbacks += d.fallbacks
        self.pipeline_firings += d.pipeline_firings
        self.tokens_in += d.tokens_in
        self.tokens_out += d.tokens_out
        self.cancellations += d.cancellations
        if d.crash_kinds:
            self.crash_signals.update(d.crash_kinds)
        if d.latency is not None:
            self._add_parsed(d.latency)
        if d.ttft is not None:
            if self.ttft is None:
                self.ttft = Aggregate()
            self.ttft._add_parsed(d.ttft)

    def add_histogram(self, h: dict) -> None:
        """Add a histogram (runtime.LatencyHistogram.to_dict() data) to the latency one."""
        parsed = ParsedHistogram.of(h)
        if parsed is not None:
            self._add_parsed(parsed)

    def _add_parsed(self, h: ParsedHistogram) -> None:
        if len(h.index):
            # In place, on the few buckets a report fills (this is the roller's hot loop;
            # every aggregate owns its array).
            old = self.buckets[h.index]
            total = old + h.count
            total[total < old] = INT64_MAX  # saturate, never wrap
            self.buckets[h.index] = total
        self._add_latency(h.n, h.sum_ns, h.min_ns, h.max_ns)

    def add_install(self, record: InstallRecord) -> None:
        """Count one install outcome."""
        name = _INSTALL_COUNTER[record.result]
        setattr(self, name, getattr(self, name) + 1)

    def merge(self, other: Aggregate) -> None:
        """Add `other` into this aggregate."""
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.crash_signals.update(other.crash_signals)
        self.buckets = saturating_add(self.buckets, other.buckets)
        if other.latency_count:
            self._add_latency(
                other.latency_count,
                other.latency_sum_ns,
                other.latency_min_ns,
                other.latency_max_ns,
            )
        if other.ttft is not None and other.ttft.latency_count:
            if self.ttft is None:
                self.ttft = Aggregate()
            self.ttft.merge(other.ttft)

    def _add_latency(self, count: int, sum_ns: int, low: int | None, high: int | None) -> None:
        self.latency_count += count
        self.latency_sum_ns += sum_ns
        if low is not None:
            low = low if self.latency_min_ns is None else min(self.latency_min_ns, low)
            self.latency_min_ns = low
        if high is not None:
            self.latency_max_ns = (
                high if self.latency_max_ns is None else max(self.latency_max_ns, high)
            )

    def histogram_only(self) -> Aggregate | None:
        """Return the latency histogram alone, as an aggregate (None when empty)."""
        if not self.latency_count:
            return None
        out = Aggregate(buckets=self.buckets)
        out._add_latency(
            self.latency_count, self.latency_sum_ns, self.latency_min_ns, self.latency_max_ns
        )
        return out

    @property
    def installs(self) -> int:
        """Return how many install outcomes were counted."""
        return self.installs_activated + self.installs_failed + self.installs_rolled_back

    def quantile_us(self, q: float, where: str = "mid") -> float | None:
        """Return the `q` quantile in microseconds (nearest rank; None when empty).

        `where` as in `runtime.histogram.bucket_estimate_ns`: "low" and "high" give the
        bounds of the bucket holding that rank, for conservative comparisons.
        """
        if not self.latency_count:
            return None
        rank = min(self.latency_count, max(1, math.ceil(q * self.latency_count)))
        index = int(np.searchsorted(np.cumsum(self.buckets), rank))
        low = float(self.latency_min_ns if self.latency_min_ns is not None else 0)
        high = float(self.latency_max_ns if self.latency_max_ns is not None else low)
        return bucket_estimate_ns(min(index, N_BUCKETS - 1), low, high, where) / 1000

    def to_dict(self) -> dict:
        """Return the counters and percentiles, JSON-able (what CLI and dashboard show)."""
        out: dict = {name: getattr(self, name) for name in COUNTERS}
        out["crash_signals"] = dict(sorted(self.crash_signals.items()))
        out["latency_count"] = self.latency_count
        for p in (50, 95, 99):
            out[f"p{p}_us"] = self.quantile_us(p / 100)
        if self.ttft is not None or self.tokens_out:
            out.update(llm_figures(self))
        return out


def llm_figures(agg: Aggregate) -> dict:
    """Return a language model's figures: decode tokens/s (median generation), TTFT in ms.

    Decode tokens per second is the reciprocal of the median decode time per token (a
    monotone map, so it is the median generation's speed, read off the same histogram).
    """
    p50 = agg.quantile_us(0.5)
    ttft = agg.ttft if agg.ttft is not None else Aggregate()
    return {
        "decode_tps": 1e6 / p50 if p50 else None,
        "ttft_p50_ms": _ms(ttft.quantile_us(0.5)),
        "ttft_p95_ms": _ms(ttft.quantile_us(0.95)),
        "ttft_count": ttft.latency_count,
    }


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1000
