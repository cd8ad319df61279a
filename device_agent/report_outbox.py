"""What the agent reports, and the queue that holds it while the control plane is away.

`Outbox` is a SQLite file in the state directory (`telemetry.db`): each batch is a
serialized `ReportRequest` with its own batch id, kept until the control plane has
acknowledged it. The queue is bounded by size and by age; when either bound is hit the
oldest batches go first and are counted, and the next batch sent carries that count
(`dropped_batches`). A batch sent twice (its reply lost) is applied once by the server.

`Collector` gathers serving stats between reports: per model version and backend config,
a mergeable latency histogram, inference and error counts, the worker crashes and
backend fallbacks the runtime recorded, and pipeline firings.

Every time a batch carries is the control plane's (contract.server_clock), whatever the
device's own clock says, and a device's periods follow one another without overlap: each
starts where the last one ended (a stretch with nothing to report is covered by the next
batch), and the first of a run starts no earlier than the last one queued before it (the
outbox keeps that end), since the control plane refuses a period that overlaps one it
has.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf.timestamp_pb2 import Timestamp

from contract.limits import strip_control
from contract.report_batches import (
    MAX_QUEUE_AGE_S,
    MAX_QUEUE_BYTES,
    MAX_TEXT,
    histogram_pb,
    new_batch_id,
    timestamp,
)
from contract.server_clock import ServerClock
from protos import device_pb2
from runtime.histogram import LatencyHistogram

log = logging.getLogger("skiff.agent")

MAX_EVENTS = 64

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    batch_id TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL,
    body BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value INTEGER NOT NULL);
"""


def clip(text: str) -> str:
    """Return `text` as a report may carry it: no control characters, cut to length."""
    text = strip_control(text)
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 3] + "..."


class Outbox:
    """A bounded, durable queue of report batches. Thread-safe."""

    def __init__(
        self,
        path: Path,
        *,
        max_bytes: int = MAX_QUEUE_BYTES,
        max_age_s: float = MAX_QUEUE_AGE_S,
    ) -> None:
        self.path, self.max_bytes, self.max_age_s = path, max_bytes, max_age_s
        self._lock = threading.Lock()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.close(fd)
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            self._db.close()
            raise OSError(f"{path}: {exc}") from None

    def close(self) -> None:
        """Close the database file."""
        with self._lock:
            self._db.close()

    @contextlib.contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield self._db
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def put(self, batch: device_pb2.ReportRequest, *, now: float | None = None) -> None:
        """Queue a batch; drop the oldest ones if the queue is over its bounds."""
        now = time.time() if now is None else now
        body = batch.SerializeToString()
        with self._tx() as db:
            db.execute(
                "INSERT INTO batches (batch_id, created_at, body) VALUES (?, ?, ?)",
                (batch.batch_id, now, body),
            )
            if batch.models:  # where the next run's first period may start
                db.execute(
                    "INSERT INTO counters VALUES ('period_end_ns', ?) ON CONFLICT(name) "
                    "DO UPDATE SET value = MAX(value, excluded.value)",
                    (batch.period_end.ToNanoseconds(),),
                )
            self._enforce(db, now)

    @property
    def period_end(self) -> float | None:
        """Return the end (control plane time) of the last serving period ever queued."""
        with self._lock:
            row = self._db.execute(
                "SELECT value FROM counters WHERE name = 'period_end_ns'"
            ).fetchone()
        return row[0] / 1e9 if row else None

    def _enforce(self, db: sqlite3.Connection, now: float) -> None:
        dropped = db.execute(
            "DELETE FROM batches WHERE created_at < ?", (now - self.max_age_s,)
        ).rowcount
        total = db.execute("SELECT COALESCE(SUM(LENGTH(body)), 0) FROM batches").fetchone()[0]
        if total > self.max_bytes:
            rows = db.execute("SELECT seq, LENGTH(body) FROM batches ORDER BY seq").fetchall()
            cut = []
            for seq, size in rows[:-1]:  # the newest batch always stays
                if total <= self.max_bytes:
                    break
                cut.append(seq)
                total -= size
            db.executemany("DELETE FROM batches WHERE seq = ?", [(s,) for s in cut])
            dropped += len(cut)
        if dropped:
            log.warning("telemetry queue full or stale: dropped the %d oldest batches", dropped)
            _count_dropped(db, dropped)

    def pending(self, limit: int = 100) -> list[device_pb2.ReportRequest]:
        """Return the oldest queued batches, the first carrying the dropped count."""
        with self._lock:
            rows = self._db.execute(
                "SELECT body FROM batches ORDER BY seq LIMIT ?", (limit,)
            ).fetchall()
            dropped = self._dropped()
        out = []
        for (body,) in rows:
            batch = device_pb2.ReportRequest()
            batch.ParseFromString(body)
            out.append(batch)
        if out:
            out[0].dropped_batches = dropped
        return out

    def _dropped(self) -> int:
        row = self._db.execute("SELECT value FROM counters WHERE name = 'dropped'").fetchone()
        return row[0] if row else 0

    @property
    def dropped(self) -> int:
        """Return how many batches were dropped and not yet reported as dropped."""
        with self._lock:
            return self._dropped()

    def discard(self, batch: device_pb2.ReportRequest) -> None:
        """Forget a batch the control plane refused for good; count it as dropped."""
        with self._tx() as db:
            gone = db.execute("DELETE FROM batches WHERE batch_id = ?", (batch.batch_id,)).rowcount
            if gone:
                _count_dropped(db, 1)

    def ack(self, batch: device_pb2.ReportRequest) -> None:
        """Forget a batch the control plane acknowledged (and the drops it reported)."""
        with self._tx() as db:
            db.execute("DELETE FROM batches WHERE batch_id = ?", (batch.batch_id,))
            if batch.dropped_batches:
                db.execute(
                    "UPDATE counters SET value = MAX(0, value - ?) WHERE name = 'dropped'",
                    (batch.dropped_batches,),
                )

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM batches").fetchone()[0]


def _count_dropped(db: sqlite3.Connection, n: int) -> None:
    db.execute(
        "INSERT INTO counters VALUES ('dropped', ?) "
        "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value",
        (n,),
    )


def open_outbox(path: Path) -> Outbox:
    """Open the queue; a damaged file is set aside (kept for a look) and a new one started.

    Telemetry never stops a device from serving its models.
    """
    try:
        return Outbox(path)
    except OSError as exc:
        if not path.exists():
            raise
        aside = path.with_name(f"{path.name}.damaged-{int(time.time())}")
        log.error("%s is damaged (%s): moved to %s, starting a new queue", path, exc, aside.name)
        os.replace(path, aside)
        for suffix in ("-wal", "-shm"):
            path.with_name(path.name + suffix).unlink(missing_ok=True)
        return Outbox(path)


@dataclass
class _Stats:
    histogram: LatencyHistogram = field(default_factory=LatencyHistogram)
    inferences: int = 0
    errors: int = 0
    pipeline_firings: int = 0
    crashes: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)
    # Language models: time to first token, tokens, cancelled generations.
    ttft: LatencyHistogram = field(default_factory=LatencyHistogram)
    tokens_in: int = 0
    tokens_out: int = 0
    cancellations: int = 0


class Collector:
    """Serving stats since the last report, per (model, version, variant, config)."""

    def __init__(self, clock: ServerClock | None = None) -> None:
        """Stamp periods with `clock` (the control plane's time; default the wall clock)."""
        self._lock = threading.Lock()
        self._stats: dict[tuple[str, int, str, str], _Stats] = {}
        self.clock = clock or ServerClock()
        self._started = self.clock.monotonic()  # the first period starts here
        self._floor = -math.inf
        self._last_end: float | None = None
        self._totals: dict[str, list[int]] = {}

    def resume_after(self, end: float | None) -> None:
        """Start the first period no earlier than `end` (a previous run's last period end)."""
        if end is not None:
            with self._lock:
                self._floor = end

    def totals(self) -> dict[str, tuple[int, int]]:
        """Return (inferences, errors) per model since the agent started."""
        with self._lock:
            return {name: (t[0], t[1]) for name, t in self._totals.items()}

    def _entry(self, key: tuple[str, int, str, str]) -> _Stats:
        entry = self._stats.get(key)
        if entry is None:
            entry = self._stats[key] = _Stats()
        return entry

    def inference(self, key: tuple[str, int, str, str], latency_ns: int, ok: bool) -> None:
        """Count one request (its latency only when it succeeded)."""
        with self._lock:
            entry = self._entry(key)
            entry.inferences += 1
            total = self._totals.setdefault(key[0], [0, 0])
            total[0] += 1
            if ok:
                entry.histogram.record_ns(latency_ns)
            else:
                entry.errors += 1
                total[1] += 1

    def generation(
        self,
        key: tuple[str, int, str, str],
        *,
        ok: bool,
        tokens_in: int = 0,
        tokens_out: int = 0,
        ttft_ns: int | None = None,
        token_ns: int | None = None,
        cancelled: bool = False,
    ) -> None:
        """Count one generation of a language model (device.proto ModelStats).

        Its latency sample is `token_ns`, the decode time per token after the first (None
        for a generation of one token or none); `ttft_ns` its time to first token.
        """
        with self._lock:
            entry = self._entry(key)
            entry.inferences += 1
            total = self._totals.setdefault(key[0], [0, 0])
            total[0] += 1
            entry.tokens_in += tokens_in
            entry.tokens_out += tokens_out
            entry.cancellations += cancelled
            if not ok:
                entry.errors += 1
                total[1] += 1
                return
            if ttft_ns is not None:
                entry.ttft.record_ns(ttft_ns)
            if token_ns is not None:
                entry.histogram.record_ns(token_ns)

    def firings(self, key: tuple[str, int, str, str], n: int) -> None:
        """Count pipeline firings that ran the model."""
        with self._lock:
            self._entry(key).pipeline_firings += n

    def events(self, key: tuple[str, int, str, str], crashes: list, fallbacks: list) -> None:
        """Add runtime crash and fallback events (runtime.CrashEvent / FallbackEvent)."""
        if not crashes and not fallbacks:
            return
        with self._lock:
            entry = self._entry(key)
            entry.crashes.extend(crashes)
            entry.fallbacks.extend(fallbacks)

    def cut(self) -> device_pb2.ReportRequest | None:
        """Return the stats since the last cut as a batch (None if nothing happened).

        The period starts where the last one ended and ends now, on the control plane's
        time; with nothing to report it goes on, and the next batch covers it.
        """
        now = self.clock.now()
        with self._lock:
            if not self._stats:
                return None
            stats, self._stats = self._stats, {}
            start = self._last_end
            if start is None:
                start = max(self.clock.at(self._started), self._floor)
            end = self._last_end = max(now, start)  # a clock re-measured back never overlaps
        batch = device_pb2.ReportRequest(
            batch_id=new_batch_id(), period_start=timestamp(start), period_end=timestamp(end)
        )
        if self.clock.reading is not None:
            batch.clock_offset_s = self.clock.offset_s

        def within(t: float) -> Timestamp:  # a runtime event's wall time, in the period
            return timestamp(min(max(self.clock.of_wall_time(t), start), end))

        for (model, version, variant, config), s in sorted(stats.items()):
            stats_pb = device_pb2.ModelStats(
                model=model,
                version=version,
                variant=variant,
                config=config,
                latency=histogram_pb(s.histogram),
                inferences=s.inferences,
                errors=s.errors,
                pipeline_firings=s.pipeline_firings,
                crashes=[_crash_pb(c, within(c.time)) for c in s.crashes[-MAX_EVENTS:]],
                fallbacks=[_fallback_pb(f, within(f.time)) for f in s.fallbacks[-MAX_EVENTS:]],
                tokens_in=s.tokens_in,
                tokens_out=s.tokens_out,
                cancellations=s.cancellations,
            )
            if s.ttft.count:
                stats_pb.ttft.CopyFrom(histogram_pb(s.ttft))
            batch.models.append(stats_pb)
        return batch


def _crash_pb(c, at: Timestamp) -> device_pb2.CrashReport:
    return device_pb2.CrashReport(
        at=at,
        config=c.config.key,
        reason=c.reason,
        signal=c.signal or "",
        idle=c.idle,
    )


def _fallback_pb(f, at: Timestamp) -> device_pb2.FallbackReport:
    return device_pb2.FallbackReport(
        at=at,
        from_config=f.from_config.key,
        to_config=f.to_config.key if f.to_config else "",
        reason=clip(f.reason),
    )


def install_batch(
    reports: list[device_pb2.InstallReport], clock: ServerClock | None = None
) -> device_pb2.ReportRequest:
    """Return a batch carrying install outcomes only (queued as soon as they happen).

    Stamped now on `clock` (the control plane's time; without one, the wall clock).
    """
    now = clock.now() if clock is not None else time.time()
    batch = device_pb2.ReportRequest(
        batch_id=new_batch_id(),
        period_start=timestamp(now),
        period_end=timestamp(now),
        installs=reports,
    )
    if clock is not None and clock.reading is not None:
        batch.clock_offset_s = clock.offset_s
    return batch


def install_report(o, at: float | None = None) -> device_pb2.InstallReport:
    """Return one install outcome (device_agent.install.InstallOutcome) as its report.

    `at` is when it happened on the control plane's clock (default: the wall clock now).
    """
    t = o.timings
    return device_pb2.InstallReport(
        at=timestamp(time.time() if at is None else at),
        model=o.model,
        version=o.version,
        variant=o.variant,
        rollout=o.rollout,
        result="activated" if o.result == "activated" else "failed",
        reason=clip(o.reason),
        config=o.config,
        download_s=t.download_s,
        verify_s=t.verify_s,
        self_test_s=t.self_test_s,
        downloaded_bytes=t.downloaded_bytes,
        resumed_from=t.resumed_from,
        url_bytes=t.url_bytes,
        probes=[
            device_pb2.ProbeReport(
                config=p.get("config") or "",
                accepted=bool(p.get("accepted")),
                p50_us=p.get("p50_us") or 0.0,
                cosine=p["cosine"] if p.get("cosine") is not None else float("nan"),
                error=clip(p.get("error") or ""),
            )
            for p in o.probes[:32]
        ],
    )


def rollback_reports(
    model: str, failed: dict, previous: dict, reason: str, at: float | None = None
) -> list[device_pb2.InstallReport]:
    """Return the reports of a rollback: `failed` rolled back, `previous` active again.

    `at` is when, on the control plane's clock (default: the wall clock now).
    """
    now = timestamp(time.time() if at is None else at)
    return [
        device_pb2.InstallReport(
            at=now,
            model=model,
            version=failed["version"],
            variant=failed["variant"],
            rollout=failed.get("rollout", ""),
            result="rolled_back",
            reason=clip(reason),
        ),
        device_pb2.InstallReport(
            at=now,
            model=model,
            version=previous["version"],
            variant=previous["variant"],
            rollout=previous.get("rollout", ""),
            result="activated",
            reason=clip(f"rolled back from v{failed['version']}"),
            config=previous.get("config", ""),
        ),
    ]
