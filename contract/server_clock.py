"""The control plane's time, as a device measures it from its signed Sync answers.

A device's wall clock may be hours off (a flat RTC battery, a clock set by hand), while
the control plane judges assignments and telemetry on its own time. Every Sync answer
carries the control plane's signed time (the assignment's `issued_at`) and echoes the
device's fresh nonce, so it was signed after the request left and before the answer came
back: when the answer arrives, the control plane's clock reads at least `issued_at` and
at most the round trip more. `ServerClock` takes the lower bound (the stamp is made after
the server's work, near the end of the trip, so that is also the likelier value) and
anchors it to the device's monotonic clock, so what it reads later follows neither the
wall clock's error nor its steps, and never runs ahead of the control plane: a period it
stamps never ends in the control plane's future. Before the first answer it reads the
wall clock shifted by the offset a previous run measured, if any.

Offsets are the device's wall clock minus the control plane's time: positive when the
device is ahead. One beyond SKEW_NOTICE_S is said in one line (`describe_offset`).
"""

from __future__ import annotations

import datetime as dt
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# An offset beyond this is worth a line in the log, `agent status` and telemetry: it is
# more than NTP or a phone network leaves, and judged on the device's own clock it would
# have made every answer look expired or not yet valid.
SKEW_NOTICE_S = 300.0


@dataclass(frozen=True)
class Reading:
    """One measurement of the device's clock against the control plane's."""

    offset_s: float  # the device's wall clock minus the control plane's time
    error_s: float  # the control plane may be up to this much later (the round trip)
    at: float  # the control plane's time of the measurement (Unix seconds)

    def to_json(self) -> dict:
        """Return the reading as JSON (an agent stores its last one)."""
        return {
            "offset_s": round(self.offset_s, 6),
            "error_s": round(self.error_s, 6),
            "measured_at": dt.datetime.fromtimestamp(self.at, dt.UTC).isoformat(),
        }

    @classmethod
    def from_json(cls, body: dict) -> Reading | None:
        """Parse a reading's JSON; None if it is not a reading."""
        try:
            offset, error = float(body["offset_s"]), float(body["error_s"])
            at = dt.datetime.fromisoformat(body["measured_at"]).timestamp()
        except (KeyError, TypeError, ValueError):
            return None
        return cls(offset, error, at) if math.isfinite(offset + error) else None


class ServerClock:
    """The control plane's time, read on the device. Thread-safe."""

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        *,
        offset_s: float = 0.0,
    ) -> None:
        """Read `wall` shifted back by `offset_s` until the first measurement."""
        self.wall, self.monotonic = wall, monotonic
        self._lock = threading.Lock()
        self._anchor = (wall() - offset_s, monotonic())  # (control plane time, monotonic)
        self.reading: Reading | None = None

    def assume_offset(self, offset_s: float) -> None:
        """Read the wall clock shifted back by `offset_s` (a previous run's measurement).

        Ignored once this clock has measured: a fresh reading beats a stored one.
        """
        with self._lock:
            if self.reading is None:
                self._anchor = (self.wall() - offset_s, self.monotonic())

    def at(self, monotonic: float) -> float:
        """Return the control plane's time (Unix seconds) at a reading of `monotonic`."""
        with self._lock:
            server, mono = self._anchor
        return server + (monotonic - mono)

    def now(self) -> float:
        """Return the control plane's time now (Unix seconds)."""
        return self.at(self.monotonic())

    def now_datetime(self) -> dt.datetime:
        """Return the control plane's time now, as an aware datetime."""
        return dt.datetime.fromtimestamp(self.now(), dt.UTC)

    def of_wall_time(self, t: float, wall: Callable[[], float] = time.time) -> float:
        """Return the control plane's time of an instant `wall` stamped `t` (runtime events).

        By its age on the clock that stamped it, so a wrong wall clock cancels out.
        """
        return self.now() - (wall() - t)

    @property
    def offset_s(self) -> float:
        """Return the device's wall clock minus the control plane's time, now."""
        return self.wall() - self.now()

    def measure(self, server_time: float, sent: float, received: float) -> Reading:
        """Take the control plane's `server_time`, signed between `sent` and `received`.

        `sent` and `received` are this clock's `monotonic` readings around the call.
        """
        received = max(received, sent)
        with self._lock:
            self._anchor = (server_time, received)
        self.reading = Reading(self.offset_s, received - sent, server_time)
        return self.reading


def skewed(offset_s: float) -> bool:
    """Return whether an offset is large enough to say so."""
    return abs(offset_s) > SKEW_NOTICE_S


def _span(seconds: float) -> str:
    seconds = abs(seconds)
    if seconds >= 7200:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 120:
        return f"{seconds / 60:.1f} min"
    return f"{seconds:.1f} s"


def describe_offset(offset_s: float) -> str:
    """Say in one line where the device's clock stands against the control plane's."""
    if not skewed(offset_s):
        return f"device clock within {_span(offset_s)} of the control plane"
    side = "ahead of" if offset_s > 0 else "behind"
    return (
        f"device clock is {_span(offset_s)} {side} the control plane; "
        "using the control plane's time"
    )


def skew_notice(said: float | None, offset_s: float) -> tuple[float | None, str | None]:
    """Return (the offset now said, the line to log, if any) after a new measurement.

    `said` is the skew last said (None: the clock was last in step). A skew is said once,
    and again only when it moved by more than SKEW_NOTICE_S or went away.
    """
    if skewed(offset_s):
        if said is None or abs(offset_s - said) > SKEW_NOTICE_S:
            return offset_s, describe_offset(offset_s)
        return said, None
    if said is not None:
        return None, f"device clock back in step with the control plane ({_span(offset_s)} off)"
    return None, None
