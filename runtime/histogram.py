"""Mergeable latency histograms: fixed log-scale buckets shared by every device.

Every histogram has the same buckets, so the control plane can add histograms from a
whole fleet (or from many reporting intervals) bucket by bucket and still read
percentiles, without ever seeing individual samples. Buckets cover 1 µs to 2^27 µs
(about 134 s) with 8 buckets per doubling, plus one underflow and one overflow bucket.

Quantile error: a quantile is reported as the geometric middle of the bucket holding the
exact (nearest-rank) sample, clamped to the observed min and max. Buckets are 2^(1/8)
wide, so for samples between 1 µs and 134 s the relative error is at most
2^(1/16) - 1, under 4.5%. Merging is exact: merging histograms gives the same counts,
sum, min and max as recording all their samples into one.

The bucket layout is plain arithmetic, so the control plane can read it without numpy;
numpy loads only for the array methods (`counts`, `record_many_ns`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

__all__ = ["BUCKETS_PER_DOUBLING", "LatencyHistogram", "MAX_RELATIVE_ERROR", "SCHEME"]

BUCKETS_PER_DOUBLING = 8
MIN_NS = 1_000  # 1 µs: anything faster is below what the runtime can time meaningfully
DOUBLINGS = 27
N_BUCKETS = DOUBLINGS * BUCKETS_PER_DOUBLING + 2  # + underflow (index 0) and overflow (last)
SCHEME = f"log2/{BUCKETS_PER_DOUBLING}-per-doubling/from-1us/{DOUBLINGS}-doublings"
MAX_RELATIVE_ERROR = 2 ** (1 / (2 * BUCKETS_PER_DOUBLING)) - 1
_LAST = N_BUCKETS - 1
_PER_MIN_NS = 1 / MIN_NS


def bucket_of(ns: int) -> int:
    """Return the bucket index of a latency of `ns` nanoseconds."""
    if ns < MIN_NS:
        return 0
    return min(_LAST, int(math.log2(ns * _PER_MIN_NS) * BUCKETS_PER_DOUBLING) + 1)


def bucket_bounds_ns(index: int) -> tuple[float, float]:
    """Return the [low, high) bounds of a regular bucket, in nanoseconds."""
    low = MIN_NS * 2 ** ((index - 1) / BUCKETS_PER_DOUBLING)
    return low, low * 2 ** (1 / BUCKETS_PER_DOUBLING)


def bucket_estimate_ns(index: int, min_ns: float, max_ns: float, where: str = "mid") -> float:
    """Return what a sample in bucket `index` is read as, clamped to the observed range.

    `where` is "mid" (the geometric middle: the quantile estimate), or "low" / "high"
    (the bucket's bounds: what a sample there is at least / at most).
    """
    if 0 < index < _LAST:
        bucket_low, bucket_high = bucket_bounds_ns(index)
        estimate = {
            "mid": math.sqrt(bucket_low * bucket_high),
            "low": bucket_low,
            "high": bucket_high,
        }[where]
    elif index == 0:  # below 1 µs: anywhere from the minimum up to 1 µs
        estimate = {"mid": min_ns, "low": min_ns, "high": MIN_NS}[where]
    else:  # above the log range: from its top up to the maximum
        estimate = {"mid": max_ns, "low": MIN_NS * 2**DOUBLINGS, "high": max_ns}[where]
    return min(max(estimate, min_ns), max_ns)


class LatencyHistogram:
    """Counts of latencies per fixed bucket, plus exact count, sum, min and max.

    Recording is thread-safe and cheap: it is on every inference's path, so buckets are
    a plain list of ints (a numpy element update costs several times more).
    """

    __slots__ = ("_lock", "_counts", "count", "sum_ns", "min_ns", "max_ns")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * N_BUCKETS
        self.count = 0
        self.sum_ns = 0
        self.min_ns: int | None = None
        self.max_ns: int | None = None

    @property
    def counts(self) -> np.ndarray:
        """Return a copy of the bucket counts as an int64 array."""
        import numpy as np

        with self._lock:
            return np.array(self._counts, dtype=np.int64)

    def record_ns(self, ns: int) -> None:
        """Record one latency of `ns` nanoseconds (an int; negative values count as 0)."""
        if ns < MIN_NS:
            ns, index = max(ns, 0), 0
        else:  # bucket_of, inlined: this runs on every inference
            index = min(_LAST, int(math.log2(ns * _PER_MIN_NS) * BUCKETS_PER_DOUBLING) + 1)
        with self._lock:
            self._counts[index] += 1
            self.count += 1
            self.sum_ns += ns
            if self.min_ns is None or ns < self.min_ns:
                self.min_ns = ns
            if self.max_ns is None or ns > self.max_ns:
                self.max_ns = ns

    def record_many_ns(self, ns: np.ndarray) -> None:
        """Record many latencies at once (an array of ns), bucketed as `record_ns` does.

        Floats are truncated to whole ns. ValueError, recording nothing, if any is NaN or
        infinite: cast to int64 they would be arbitrary numbers, counted in some bucket.
        """
        import numpy as np

        ns = np.asarray(ns)
        if ns.dtype.kind == "f" and not np.isfinite(ns).all():
            raise ValueError("latencies must be finite (NaN or infinity given)")
        ns = np.maximum(ns.astype(np.int64), 0)
        if not len(ns):
            return
        index = np.zeros(len(ns), dtype=np.int64)
        timed = ns >= MIN_NS
        index[timed] = np.minimum(
            _LAST, (np.log2(ns[timed] * _PER_MIN_NS) * BUCKETS_PER_DOUBLING).astype(np.int64) + 1
        )
        counts = np.bincount(index, minlength=N_BUCKETS)
        low, high, total = int(ns.min()), int(ns.max()), int(ns.sum())
        with self._lock:
            for i in np.flatnonzero(counts):
                self._counts[i] += int(counts[i])
            self.count += len(ns)
            self.sum_ns += total
            self.min_ns = low if self.min_ns is None else min(self.min_ns, low)
            self.max_ns = high if self.max_ns is None else max(self.max_ns, high)

    def record(self, seconds: float) -> None:
        """Record one latency given in seconds."""
        self.record_ns(round(seconds * 1e9))

    def _index_of(self, rank: int) -> int:
        """Return the bucket holding the `rank`-th smallest sample (caller holds the lock)."""
        seen = 0
        for index, count in enumerate(self._counts):
            seen += count
            if seen >= rank:
                return index
        return _LAST

    def quantile(self, q: float) -> float | None:
        """Return the `q` quantile (0 < q <= 1) in microseconds; None if empty.

        Nearest-rank definition; see the module docstring for the error bound.
        """
        if not 0 < q <= 1:
            raise ValueError(f"q must be in (0, 1], not {q}")
        with self._lock:
            if not self.count:
                return None
            index = self._index_of(max(1, math.ceil(q * self.count)))
            low_ns, high_ns = float(self.min_ns), float(self.max_ns)
        return bucket_estimate_ns(index, low_ns, high_ns) / 1000

    def percentiles(self) -> dict[str, float | None]:
        """Return p50, p95 and p99 in microseconds (None when empty)."""
        return {f"p{p}_us": self.quantile(p / 100) for p in (50, 95, 99)}

    @property
    def mean_us(self) -> float | None:
        """Return the exact mean in microseconds, or None when empty."""
        return self.sum_ns / self.count / 1000 if self.count else None

    def merge(self, other: LatencyHistogram) -> LatencyHistogram:
        """Return a new histogram holding the samples of both."""
        merged = self.copy()
        merged.update(other)
        return merged

    __add__ = merge

    def update(self, other: LatencyHistogram) -> None:
        """Add `other`'s samples to this histogram in place."""
        snapshot = other.copy()  # never hold both locks at once
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, snapshot._counts, strict=True)]
            self.count += snapshot.count
            self.sum_ns += snapshot.sum_ns
            self.min_ns = _pick(min, self.min_ns, snapshot.min_ns)
            self.max_ns = _pick(max, self.max_ns, snapshot.max_ns)

    def copy(self, *, reset: bool = False) -> LatencyHistogram:
        """Return a snapshot; with `reset`, also empty this one (one reporting interval)."""
        out = LatencyHistogram()
        with self._lock:
            out._counts = list(self._counts)
            out.count, out.sum_ns = self.count, self.sum_ns
            out.min_ns, out.max_ns = self.min_ns, self.max_ns
            if reset:
                self._counts = [0] * N_BUCKETS
                self.count = self.sum_ns = 0
                self.min_ns = self.max_ns = None
        return out

    def to_dict(self) -> dict[str, Any]:
        """Return a compact JSON-able dict (non-empty buckets only) for telemetry."""
        with self._lock:
            return {
                "scheme": SCHEME,
                "count": self.count,
                "sum_ns": self.sum_ns,
                "min_ns": self.min_ns,
                "max_ns": self.max_ns,
                "buckets": [[i, n] for i, n in enumerate(self._counts) if n],
            }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LatencyHistogram:
        """Rebuild a histogram from `to_dict` output; ValueError if it is inconsistent."""
        if d.get("scheme") != SCHEME:
            raise ValueError(f"histogram scheme {d.get('scheme')!r} is not {SCHEME!r}")
        out = cls()
        for index, count in d["buckets"]:
            if not 0 <= int(index) < N_BUCKETS or int(count) < 0:
                raise ValueError(f"bad histogram bucket [{index}, {count}]")
            out._counts[int(index)] += int(count)
        out.count, out.sum_ns = int(d["count"]), int(d["sum_ns"])
        out.min_ns = None if d["min_ns"] is None else int(d["min_ns"])
        out.max_ns = None if d["max_ns"] is None else int(d["max_ns"])
        if sum(out._counts) != out.count:
            raise ValueError("histogram bucket counts do not add up to its count")
        return out

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LatencyHistogram):
            return NotImplemented
        a, b = self.copy(), other.copy()
        same_stats = (a.count, a.sum_ns, a.min_ns, a.max_ns) == (
            b.count,
            b.sum_ns,
            b.min_ns,
            b.max_ns,
        )
        return same_stats and a._counts == b._counts

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"LatencyHistogram(count={self.count}, {self.percentiles()})"


def _pick(fn: Any, a: int | None, b: int | None) -> int | None:
    """Apply min/max to two optional values, ignoring None."""
    if a is None or b is None:
        return a if b is None else b
    return fn(a, b)
