"""Device rows of one scope as columns, read tens of thousands at once.

What a rollout's health view and a version's backend table compute over
(control_plane.telemetry.robust): array operations, not an object per row.
"""

from __future__ import annotations

import datetime as dt
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from control_plane.store.rollup_aggregate import COUNTERS, Aggregate
from control_plane.store.rollup_records import DeviceKey, DeviceRollup


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
