"""What an agent's reports carry, in the forms both sides read: ids, times, histograms.

A report batch has a random id (a batch sent twice is applied once), protobuf timestamps
in the control plane's time, and latency histograms in the runtime's layout
(`runtime.histogram`: log-spaced buckets; the message names the scheme). An agent keeps
at most MAX_QUEUE_BYTES of batches for at most MAX_QUEUE_AGE_S while the control plane is
away, and flushes for at most FLUSH_ON_STOP_S when it stops; the simulator's devices
follow the same bounds. MAX_TEXT is what the control plane accepts for a reason or an
error line.
"""

from __future__ import annotations

import datetime as dt
import secrets
from typing import Any, Protocol

from google.protobuf.timestamp_pb2 import Timestamp

from protos import device_pb2

MAX_QUEUE_BYTES = 4 << 20
MAX_QUEUE_AGE_S = 7 * 24 * 3600.0
MAX_TEXT = 1000  # what the control plane accepts for a reason or error line
FLUSH_ON_STOP_S = 5.0


class SupportsToDict(Protocol):
    """A histogram that gives its JSON form (`runtime.histogram.LatencyHistogram`)."""

    def to_dict(self) -> dict[str, Any]:
        """Return scheme, count, sum_ns, min_ns, max_ns and [index, count] buckets."""
        ...


def new_batch_id() -> str:
    """Return a fresh batch id: random, so two agents never collide."""
    return "b" + secrets.token_hex(12)


def timestamp(value: float | dt.datetime) -> Timestamp:
    """Return a protobuf timestamp for a Unix time or an aware datetime."""
    ts = Timestamp()
    if isinstance(value, dt.datetime):
        ts.FromDatetime(value)
    else:
        ts.FromNanoseconds(int(value * 1e9))
    return ts


def histogram_pb(h: SupportsToDict) -> device_pb2.LatencyHistogram:
    """Return a latency histogram (`runtime.histogram.LatencyHistogram`) as its message."""
    body = h.to_dict()
    msg = device_pb2.LatencyHistogram(
        scheme=body["scheme"],
        count=body["count"],
        sum_ns=body["sum_ns"],
        bucket_index=[i for i, _ in body["buckets"]],
        bucket_count=[n for _, n in body["buckets"]],
    )
    if body["min_ns"] is not None:
        msg.min_ns, msg.max_ns = body["min_ns"], body["max_ns"]
    return msg
