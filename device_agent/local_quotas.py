"""What apps on the device may ask of one model through the local API, and its bookkeeping.

Apps are trusted only as far as the socket's permissions go: a buggy or hostile one must
not starve the model (every firing runs it) or the agent. Per model, all apps together:

* events pushed: `events_per_s` sustained, `events_burst` at once (by default one push of
  the largest size, `MAX_EVENTS`). A push is let in whole or not at all: a refused one
  applied nothing and is told when the same push would fit. Every push counts at least
  one event, and one refused as invalid after it was let in still counts (its events
  were read).
* model runs from firings: `runs_per_s` sustained, `runs_burst` at once. How many runs a
  push fires is known only once the engine has taken it, and a batch is never cut
  short, so its runs are charged then and may overdraw the bucket: the model's next
  pushes are refused until the overdraft is paid back at `runs_per_s`.
* open `Subscribe` streams: `subscribers`.

The defaults sit far above what an app pushes in normal use (taps and scrolls come in
tens a second, sensor samples in hundreds) and below what costs the device: turning
events from protobuf into arrays takes about 2 us each with the GIL held, and each
firing runs the model in its worker process, at least 0.17 ms for a tiny MLP on a
desktop core and milliseconds for real models on phones.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

# The largest push that is read at all (device_agent.pipelines refuses bigger ones).
MAX_EVENTS = 65_536
# Float slack: a retry at exactly the advised time must get in.
_EPSILON = 1e-6


class Overloaded(Exception):
    """An app asked more of a model than its AppLimits allow; nothing of it was done.

    `retry_after_s` is when the same request would be let in (None: no way to know, e.g.
    until a subscriber leaves).
    """

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class AppLimits:
    """Per-model bounds on what apps ask through the local API (see the module doc)."""

    events_per_s: float = 10_000
    events_burst: int = MAX_EVENTS
    runs_per_s: float = 500
    # About the firings of one full push of the sample shopping events (1 in 13 fires).
    runs_burst: int = 5_000
    subscribers: int = 16

    def __post_init__(self) -> None:
        for name in ("events_per_s", "runs_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("events_burst", "runs_burst", "subscribers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class TokenBucket:
    """`rate` tokens a second, held up to `burst`, starting full; its owner locks it."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        self.rate, self.burst, self._clock = rate, burst, clock
        self._level, self._at = float(burst), clock()

    def level(self) -> float:
        """Return the tokens there now (negative while overdrawn)."""
        now = self._clock()
        # A clock that steps back (a test's, or a bad one) must not drain the bucket.
        self._level = min(self.burst, self._level + max(0.0, now - self._at) * self.rate)
        self._at = max(now, self._at)
        return self._level

    def wait_s(self, n: float) -> float:
        """Return the seconds until `n` tokens are there (0: now)."""
        return max(0.0, (n - _EPSILON - self.level()) / self.rate)

    def take(self, n: float) -> None:
        """Take `n` tokens, overdrawing if need be."""
        self._level = self.level() - n


class _Buckets:
    def __init__(self, limits: AppLimits, clock: Callable[[], float]) -> None:
        self.lock = threading.Lock()
        self.events = TokenBucket(limits.events_per_s, limits.events_burst, clock)
        self.runs = TokenBucket(limits.runs_per_s, limits.runs_burst, clock)


class RateLimits:
    """Every model's event and model-run buckets; thread-safe.

    Buckets are made for a model on its first push (callers admit only models that
    serve a pipeline, so their number is bounded by the installed models).
    """

    def __init__(self, limits: AppLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self._clock = clock
        self._lock = threading.Lock()
        self._models: dict[str, _Buckets] = {}

    def admit(self, name: str, events: int) -> None:
        """Take a push of `events` events for `name`, or raise Overloaded taking nothing."""
        buckets = self._buckets(name)
        cost = max(events, 1)
        with buckets.lock:
            wait_events = buckets.events.wait_s(cost)
            wait_runs = buckets.runs.wait_s(1)
            if not wait_events and not wait_runs:
                buckets.events.take(cost)
                return
        lim, wait = self.limits, max(wait_events, wait_runs)
        shown = pushback_ms(wait) / 1000  # never earlier than the trailer says
        if wait_events >= wait_runs:
            what = (
                f"pushes are limited to {lim.events_per_s:g} events/s (bursts of "
                f"{lim.events_burst}): this push of {events} events fits in {shown:.3f} s"
            )
        else:
            what = (
                f"its pipeline's firings are limited to {lim.runs_per_s:g} model runs/s "
                f"(bursts of {lim.runs_burst}), used up for {shown:.3f} s"
            )
        raise Overloaded(f"{name}: {what}: retry then", wait)

    def charge_runs(self, name: str, runs: int) -> None:
        """Count `runs` model runs of `name`'s firings (the bucket may be overdrawn)."""
        if runs:
            buckets = self._buckets(name)
            with buckets.lock:
                buckets.runs.take(runs)

    def forget(self, name: str) -> None:
        """Drop `name`'s buckets (the model was removed)."""
        with self._lock:
            self._models.pop(name, None)

    def _buckets(self, name: str) -> _Buckets:
        with self._lock:
            buckets = self._models.get(name)
            if buckets is None:
                buckets = self._models[name] = _Buckets(self.limits, self._clock)
            return buckets


def pushback_ms(retry_after_s: float) -> int:
    """Return gRPC's `grpc-retry-pushback-ms` value for a wait (whole ms, never early)."""
    return math.ceil(retry_after_s * 1000)
