"""The rollup store interface, and the mergeable aggregate a rollup row holds.

A rollup row is one group of devices (model, version, variant, backend config, device
class; optionally one cohort of one rollout) over one time bucket. Every field adds up
exactly across rows: counters, crash signals and latency histograms (the same fixed
buckets as `runtime.histogram`), so any window or grouping is a merge of rows.
"""

from __future__ import annotations

import abc
import collections
import datetime as dt
import functools
import hashlib
import json
import math
import signal
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace

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


@dataclass(frozen=True)
class RollupKey:
    """The group one rollup row holds; `rollout`/`cohort` empty for fleet-wide groups."""

    model: str
    version: int
    variant: str
    config: str
    device_class: str
    rollout: str = ""
    cohort: str = ""

    @property
    def digest(self) -> str:
        """Return the key's identity within a bucket (SHA-256 hex of every field)."""
        text = json.dumps(
            [
                self.model,
                self.version,
                self.variant,
                self.config,
                self.device_class,
                self.rollout,
                self.cohort,
            ],
            ensure_ascii=False,
        )
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class PendingBatch:
    """A stored telemetry batch the roller has not merged yet, with its device's attributes."""

    device_id: str
    batch_id: str
    period_end: dt.datetime
    attributes: dict
    models: tuple[ModelStatsRecord, ...]
    installs: tuple[InstallRecord, ...]


# Scope of the fleet-wide device rows (backend recommendations), and their one window.
FLEET = ""
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
# The cohorts a rollout's rows are kept under: which one a report is in is the rollouts'
# call (control_plane.rollouts.resolver.Snapshot.placements); its name is stored here.
CANDIDATE, BASELINE, OUTSIDE = "candidate", "baseline", "outside"


@dataclass(frozen=True)
class DeviceKey:
    """One device's row: in a rollout's cohort and window, or fleet-wide (scope FLEET).

    A rollout's rows are per window (`window` is the start of the stage, or of a slice's
    readmission, the report fell in), so a cohort's figures over its current window are
    a sum of whole rows, per device: guardrails need each device's own figures to keep any
    one device from deciding a verdict (control_plane.telemetry.robust).
    """

    scope: str
    window: dt.datetime
    cohort: str
    model: str
    version: int
    variant: str
    config: str
    device_id: str

    @property
    def digest(self) -> str:
        """Return the row's identity (SHA-256 hex of every field)."""
        text = json.dumps(
            [
                self.scope,
                int(self.window.timestamp()),
                self.cohort,
                self.model,
                self.version,
                self.variant,
                self.config,
                self.device_id,
            ],
            ensure_ascii=False,
        )
        return hashlib.sha256(text.encode()).hexdigest()


@dataclass
class DeviceDelta:
    """What a roller round adds to one device row."""

    device_class: str
    last_seen: dt.datetime
    reports: int = 0
    aggregate: Aggregate = field(default_factory=Aggregate)

    def add(self, other: DeviceDelta) -> None:
        """Merge another delta of the same row (the later class wins)."""
        if other.last_seen >= self.last_seen:
            self.device_class, self.last_seen = other.device_class, other.last_seen
        self.reports += other.reports
        self.aggregate.merge(other.aggregate)


@dataclass(frozen=True)
class DeviceRollup:
    """A stored device row: its key, latest class and time, reports and aggregate.

    The histogram is kept sparse (`index`, `counts`): a rollout may hold a row for every
    device of a large fleet, and a dense histogram is 218 counts.
    """

    key: DeviceKey
    device_class: str
    last_seen: dt.datetime
    reports: int
    counters: dict[str, int]
    crash_signals: dict[str, int]
    latency_count: int
    latency_sum_ns: int
    latency_min_ns: int | None
    latency_max_ns: int | None
    index: np.ndarray
    counts: np.ndarray
    # A language model's time to first token (Aggregate.ttft); None when none was timed.
    ttft: Aggregate | None = None

    @classmethod
    def of(
        cls,
        key: DeviceKey,
        aggregate: Aggregate,
        *,
        device_class: str = "{}",
        last_seen: dt.datetime = EPOCH,
        reports: int = 1,
    ) -> DeviceRollup:
        """Return a row holding `aggregate` (what the store reads back after a merge)."""
        index = np.flatnonzero(aggregate.buckets)
        return cls(
            key=key,
            device_class=device_class,
            last_seen=last_seen,
            reports=reports,
            counters={name: getattr(aggregate, name) for name in COUNTERS},
            crash_signals=dict(aggregate.crash_signals),
            latency_count=aggregate.latency_count,
            latency_sum_ns=aggregate.latency_sum_ns,
            latency_min_ns=aggregate.latency_min_ns,
            latency_max_ns=aggregate.latency_max_ns,
            index=index.astype("<u2"),
            counts=aggregate.buckets[index].astype("<i8"),
            ttft=aggregate.ttft,
        )

    def histogram(self) -> Aggregate | None:
        """Return the row's latency histogram alone, as an aggregate (None when empty)."""
        return self.aggregate().histogram_only()

    def aggregate(self) -> Aggregate:
        """Return the row as a (dense) aggregate."""
        agg = Aggregate(**self.counters)
        agg.crash_signals.update(self.crash_signals)
        if self.latency_count:
            agg._add_latency(
                self.latency_count, self.latency_sum_ns, self.latency_min_ns, self.latency_max_ns
            )
            agg.buckets[self.index.astype(np.intp)] = self.counts
        if self.ttft is not None and self.ttft.latency_count:
            agg.ttft = Aggregate()
            agg.ttft.merge(self.ttft)
        return agg


@dataclass(frozen=True, eq=False)
class DeviceTable:
    """Device rows of one scope as columns, so figures are array operations.

    What a rollout's health view or a version's backend table reads: tens of thousands
    of rows, which one Python object each would make slow.

    Counters are float64 (exact for sums below 2**53); a missing latency min or max is
    NaN. The sparse histograms of every row are concatenated: bucket `hist_index[j]`
    holds `hist_count[j]` samples of row `hist_row[j]`.

    A lean table (`RollupStore.device_table(lean=True)`) leaves out the `LEAN_SKIPS`
    columns, None there: nothing a health view reads, and reading them costs it.
    """

    window: np.ndarray  # Unix seconds
    cohort: np.ndarray  # object: str
    model: np.ndarray | None  # object: str
    version: np.ndarray | None  # int64
    variant: np.ndarray | None  # object: str
    config: np.ndarray  # object: str
    device_id: np.ndarray  # object: str
    device_class: np.ndarray  # object: str
    last_seen: np.ndarray | None  # Unix seconds
    reports: np.ndarray | None  # int64
    counters: np.ndarray  # float64, (rows, len(COUNTERS))
    latency_count: np.ndarray  # float64
    latency_sum_ns: np.ndarray  # float64
    latency_min_ns: np.ndarray  # float64, NaN when none
    latency_max_ns: np.ndarray  # float64, NaN when none
    crash_signals: np.ndarray  # object: Mapping[str, int] (read-only; shared when empty)
    hist_row: np.ndarray  # intp
    hist_index: np.ndarray  # intp
    hist_count: np.ndarray  # float64
    scope: str = ""
    # A language model's time to first token, row for row: a table of the same rows whose
    # latency columns and histograms are TTFT's (see `ttft_view`); None when no row has any.
    ttft: DeviceTable | None = None

    def __len__(self) -> int:
        return len(self.window)

    @classmethod
    def from_rows(cls, rows: Sequence[DeviceRollup]) -> DeviceTable:
        """Return rows (as the store returns them one by one) as a table."""
        sizes = [len(r.index) for r in rows]
        table = cls(
            scope=rows[0].key.scope if rows else "",
            window=np.array([r.key.window.timestamp() for r in rows], np.float64),
            cohort=_objects(r.key.cohort for r in rows),
            model=_objects(r.key.model for r in rows),
            version=np.array([r.key.version for r in rows], np.int64),
            variant=_objects(r.key.variant for r in rows),
            config=_objects(r.key.config for r in rows),
            device_id=_objects(r.key.device_id for r in rows),
            device_class=_objects(r.device_class for r in rows),
            last_seen=np.array([r.last_seen.timestamp() for r in rows], np.float64),
            reports=np.array([r.reports for r in rows], np.int64),
            counters=np.array(
                [[r.counters[name] for name in COUNTERS] for r in rows], np.float64
            ).reshape(len(rows), len(COUNTERS)),
            latency_count=np.array([r.latency_count for r in rows], np.float64),
            latency_sum_ns=np.array([r.latency_sum_ns for r in rows], np.float64),
            latency_min_ns=_nullable(r.latency_min_ns for r in rows),
            latency_max_ns=_nullable(r.latency_max_ns for r in rows),
            crash_signals=_objects(r.crash_signals for r in rows),
            hist_row=np.repeat(np.arange(len(rows)), sizes).astype(np.intp),
            hist_index=np.concatenate([r.index for r in rows] or [_NO_INDEX]).astype(np.intp),
            hist_count=np.concatenate([r.counts for r in rows] or [_NO_COUNT]).astype(np.float64),
        )
        if not any(r.ttft is not None and r.ttft.latency_count for r in rows):
            return table
        ttft = cls.from_rows([DeviceRollup.of(r.key, r.ttft or Aggregate()) for r in rows])
        return table.with_ttft(ttft)

    def with_ttft(self, source: DeviceTable) -> DeviceTable:
        """Return this table with `source`'s latency as its time to first token.

        `source` holds the same rows in the same order.
        """
        view = replace(
            self,
            latency_count=source.latency_count,
            latency_sum_ns=source.latency_sum_ns,
            latency_min_ns=source.latency_min_ns,
            latency_max_ns=source.latency_max_ns,
            hist_row=source.hist_row,
            hist_index=source.hist_index,
            hist_count=source.hist_count,
            ttft=None,
        )
        return replace(self, ttft=view)

    @functools.cached_property
    def device_code(self) -> np.ndarray:
        """Return a small integer per distinct device id (one pass, cached)."""
        return _codes(self.device_id)

    @functools.cached_property
    def config_code(self) -> np.ndarray:
        """Return a small integer per distinct backend config (one pass, cached)."""
        return _codes(self.config)

    @functools.cached_property
    def with_signals(self) -> np.ndarray:
        """Return per row whether it names any crash signals (one pass, cached)."""
        return np.fromiter(map(bool, self.crash_signals), bool, len(self))

    @functools.cached_property
    def device_first_row(self) -> np.ndarray:
        """Return per device code the first row holding it."""
        return np.unique(self.device_code, return_index=True)[1]

    @functools.cached_property
    def config_first_row(self) -> np.ndarray:
        """Return per config code the first row holding it."""
        return np.unique(self.config_code, return_index=True)[1]

    @functools.cached_property
    def _hist_start(self) -> np.ndarray:
        # hist_row is ascending: each row's buckets are one run of the histogram arrays.
        return np.searchsorted(self.hist_row, np.arange(len(self) + 1))

    def histograms(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return the buckets of some rows: (entry, index, count), entry = position in `rows`.

        Costs what those rows hold, not what the table holds.
        """
        start = self._hist_start[rows]
        sizes = self._hist_start[rows + 1] - start
        total = int(sizes.sum())
        entry = np.repeat(np.arange(len(rows)), sizes)
        at = np.repeat(start - np.concatenate(([0], np.cumsum(sizes)[:-1])), sizes) + np.arange(
            total
        )
        return entry, self.hist_index[at], self.hist_count[at]

    def take(self, rows: np.ndarray) -> DeviceTable:
        """Return a table of some rows (positions, in the order given)."""
        rows = np.asarray(rows, np.intp)
        new = np.full(len(self), -1, np.intp)
        new[rows] = np.arange(len(rows))
        kept = new[self.hist_row]
        mask = kept >= 0
        order = np.argsort(kept[mask], kind="stable")
        return DeviceTable(
            **{name: _pick(getattr(self, name), rows) for name in _ROW_COLUMNS},
            hist_row=kept[mask][order],
            hist_index=self.hist_index[mask][order],
            hist_count=self.hist_count[mask][order],
            scope=self.scope,
            ttft=self.ttft.take(rows) if self.ttft is not None else None,
        )

    def concat(self, other: DeviceTable) -> DeviceTable:
        """Return this table's rows, then `other`'s."""
        return DeviceTable(
            **{name: _joined(getattr(self, name), getattr(other, name)) for name in _ROW_COLUMNS},
            hist_row=np.concatenate([self.hist_row, other.hist_row + len(self)]),
            hist_index=np.concatenate([self.hist_index, other.hist_index]),
            hist_count=np.concatenate([self.hist_count, other.hist_count]),
            scope=self.scope,
            ttft=(
                None
                if self.ttft is None and other.ttft is None
                else self.ttft_view().concat(other.ttft_view())
            ),
        )

    def ttft_view(self) -> DeviceTable:
        """Return the same rows with time to first token as their latency.

        robust.Devices then judges it as it judges latency; rows without any hold an
        empty histogram.
        """
        if self.ttft is not None:
            return self.ttft
        none = np.full(len(self), np.nan)
        return replace(
            self,
            latency_count=np.zeros(len(self)),
            latency_sum_ns=np.zeros(len(self)),
            latency_min_ns=none,
            latency_max_ns=none,
            hist_row=_NO_INDEX,
            hist_index=_NO_INDEX,
            hist_count=_NO_COUNT,
            ttft=None,
        )

    def rows(self) -> list[DeviceRollup]:
        """Return the table as rows (for a few; tests and small reads); not of a lean one."""
        if self.model is None:
            raise ValueError(f"a lean device table has no {', '.join(LEAN_SKIPS)}: no rows")
        out = []
        ttft = self.ttft.rows() if self.ttft is not None else None
        for i in range(len(self)):
            mine = slice(self._hist_start[i], self._hist_start[i + 1])
            low, high = self.latency_min_ns[i], self.latency_max_ns[i]
            out.append(
                DeviceRollup(
                    key=DeviceKey(
                        self.scope,
                        dt.datetime.fromtimestamp(self.window[i], dt.UTC),
                        self.cohort[i],
                        self.model[i],
                        int(self.version[i]),
                        self.variant[i],
                        self.config[i],
                        self.device_id[i],
                    ),
                    device_class=self.device_class[i],
                    last_seen=dt.datetime.fromtimestamp(self.last_seen[i], dt.UTC),
                    reports=int(self.reports[i]),
                    counters={n: int(v) for n, v in zip(COUNTERS, self.counters[i], strict=True)},
                    crash_signals=dict(self.crash_signals[i]),
                    latency_count=int(self.latency_count[i]),
                    latency_sum_ns=int(self.latency_sum_ns[i]),
                    latency_min_ns=None if math.isnan(low) else int(low),
                    latency_max_ns=None if math.isnan(high) else int(high),
                    index=self.hist_index[mine].astype("<u2"),
                    counts=self.hist_count[mine].astype("<i8"),
                    ttft=ttft[i].histogram() if ttft is not None else None,
                )
            )
        return out


_ROW_COLUMNS = (
    "window",
    "cohort",
    "model",
    "version",
    "variant",
    "config",
    "device_id",
    "device_class",
    "last_seen",
    "reports",
    "counters",
    "latency_count",
    "latency_sum_ns",
    "latency_min_ns",
    "latency_max_ns",
    "crash_signals",
)
# What a lean DeviceTable leaves out (None): nothing a health view reads.
LEAN_SKIPS = ("model", "version", "variant", "last_seen", "reports")
_NO_INDEX = np.zeros(0, np.intp)
_NO_COUNT = np.zeros(0, np.float64)


def _pick(column: np.ndarray | None, rows: np.ndarray) -> np.ndarray | None:
    return None if column is None else column[rows]


def _joined(first: np.ndarray | None, second: np.ndarray | None) -> np.ndarray | None:
    if first is None or second is None:
        if (first is None) != (second is None):
            raise ValueError("a lean device table joins only another lean one")
        return None
    return np.concatenate([first, second])


def _codes(values: np.ndarray) -> np.ndarray:
    # Codes in order of first appearance; `map` over a dict's lookup, not a generator.
    seen = {v: i for i, v in enumerate(dict.fromkeys(values))}
    return np.fromiter(map(seen.__getitem__, values), np.intp, len(values))


def _objects(values) -> np.ndarray:
    items = list(values)
    out = np.empty(len(items), object)
    out[:] = items
    return out


def _nullable(values) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], np.float64)


def decode_many(blobs: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Decode many `encode_buckets` blobs at once: (row, index, count) per bucket held."""
    sizes = np.fromiter(map(len, blobs), np.int64, len(blobs))
    if (sizes % 10).any():
        raise ValueError("sparse histogram of a wrong length")
    n = sizes // 10
    total = int(n.sum())
    if not total:
        return _NO_INDEX, _NO_INDEX, _NO_COUNT
    buf = np.frombuffer(b"".join(blobs), np.uint8)
    # Each blob is its 2n index bytes, then its 8n count bytes: pick each kind's bytes
    # with one mask over the joined blobs (a third of the time of gathering them).
    runs = np.empty(2 * len(blobs), np.int64)
    runs[0::2], runs[1::2] = 2 * n, 8 * n
    is_index = np.repeat(np.tile(np.array([True, False]), len(blobs)), runs)
    index = buf[is_index].view("<u2").astype(np.intp)
    count = buf[~is_index].view("<i8").astype(np.float64)
    return np.repeat(np.arange(len(blobs), dtype=np.intp), n), index, count


class RollupStore(abc.ABC):
    """Where rolled-up telemetry is kept."""

    @abc.abstractmethod
    def pending_batches(
        self, *, limit: int, received_before: dt.datetime | None = None
    ) -> list[PendingBatch]:
        """Return up to `limit` batches not yet rolled up, oldest first."""

    @abc.abstractmethod
    def apply_rollups(
        self,
        batches: list[tuple[str, str]],
        deltas: dict[tuple[int, dt.datetime, RollupKey], Aggregate],
        device_deltas: dict[DeviceKey, DeviceDelta],
    ) -> bool:
        """Merge `deltas` and `device_deltas`, and mark `batches` rolled, in one transaction.

        False (and nothing written) when another roller rolled any of them first.
        """

    @abc.abstractmethod
    def prune_telemetry(
        self,
        *,
        raw_before: dt.datetime,
        batches_before: dt.datetime,
        installs_before: dt.datetime,
        cutoffs: dict[int, dt.datetime],
        rollout_devices_before: dt.datetime,
        fleet_devices_before: dt.datetime,
    ) -> dict[str, int]:
        """Delete old telemetry; return how many rows of each kind went.

        Rolled model stats before `raw_before`, batch ids (kept for de-duplication)
        before `batches_before`, install reports before `installs_before`, rollups past
        their resolution's cutoff, device rows last seen before their scope's cutoff.
        """

    @abc.abstractmethod
    def merged_rollups(
        self,
        *,
        resolution_s: int,
        since: dt.datetime,
        until: dt.datetime | None = None,
        rollout: str | None = None,
        model: str | None = None,
        version: int | None = None,
        group: Callable[[dt.datetime, RollupKey], Hashable] = lambda _at, key: key,
    ) -> dict[Hashable, Aggregate]:
        """Merge rollup rows of one resolution with bucket_start in [since, until).

        Rows are merged per `group(bucket_start, key)` (None: skip the row); with
        `rollout` None, fleet-wide rows only.
        """

    @abc.abstractmethod
    def device_table(
        self,
        scope: str,
        *,
        model: str | None = None,
        version: int | None = None,
        seen_since: dt.datetime | None = None,
        windows_since: dt.datetime | None = None,
        windows_before: dt.datetime | None = None,
        cohorts: tuple[str, ...] | None = None,
        lean: bool = False,
    ) -> DeviceTable:
        """Return the device rows of one scope (a rollout id, or FLEET) as a table.

        Optionally only one model version's, only rows seen since `seen_since`, only
        windows starting in [windows_since, windows_before), only these cohorts'; `lean`:
        without the `LEAN_SKIPS` columns (None in the table), which a health view never
        reads.
        """

    @abc.abstractmethod
    def cohort_totals(self, scope: str, cohort: str) -> tuple[int, int]:
        """Return (reports, distinct devices) of one cohort's rows over every window."""

    def device_rollups(self, scope: str, **filters) -> list[DeviceRollup]:
        """Return `device_table`'s rows one by one (for a few: tests, small reads)."""
        return self.device_table(scope, **filters).rows()
