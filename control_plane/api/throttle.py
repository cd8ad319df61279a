"""Failed-attempt throttling: per client address and overall, with a Retry-After.

A bad API token at the dashboard login (or on its JSON API), or a bad enrollment token at
Enroll, is a guess. Tokens are 256-bit random, so guessing one is hopeless, but an
unthrottled check is still an oracle that answers hundreds of guesses a second and costs a
database query each. A `Throttle` counts failed attempts per key (the client's address,
see `client_key`) and overall, and says when a key must wait before its next attempt.

The scheme is GCRA (the generic cell rate algorithm, a token bucket kept as one
timestamp): each failure fills a key's bucket by one and the bucket drains by one every
`interval_s`; a key may try while there is room for one more failure. So `burst` failures
in a row are free, then one more every `interval_s`; a quiet key's budget refills. Refused
attempts are not counted (the caller never checked the token), so Retry-After is exact.

Successes consume nothing, and they do not reset a key's failures: whoever holds one
valid token could otherwise log in between guesses at others. A success does vouch for
its key against the overall limit for `trusted_for_s`: a distributed guesser fills the
overall bucket, and a script or operator that has recently succeeded from its address
keeps working meanwhile; a first login from a new address waits like everyone else.

Memory is bounded twice: a key is forgotten once its bucket has drained, and the overall
limit caps how many failures (so how many keys) a drain period can hold. `max_keys`
is the hard bound beyond that, for callers that record failures without checking first;
past it the key that failed longest ago is dropped.
"""

from __future__ import annotations

import collections
import contextlib
import ipaddress
import logging
import math
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from contract import errors

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limit:
    """`burst` failures allowed at once, then one more every `interval_s` seconds."""

    burst: int
    interval_s: float

    def __post_init__(self) -> None:
        if self.burst < 1 or not self.interval_s > 0:
            raise ValueError(f"a limit needs burst >= 1 and interval_s > 0, not {self}")

    @property
    def window_s(self) -> float:
        """Return how long a full bucket takes to drain (and its key to be forgotten)."""
        return self.burst * self.interval_s


# Per address: ten wrong tokens in a row are typos or a stale paste, not an attack; after
# them one guess a minute (1,440 a day) makes an oracle useless and costs the database
# nothing. A full bucket drains in 10 minutes.
PER_KEY = Limit(burst=10, interval_s=60.0)
# Overall: ten addresses' worth of bursts, then one failure a second from everyone
# together, so a distributed guesser gets at most 86,400 guesses a day (against 2**256)
# and one address alone can never trip it (its own limit is 60x slower).
OVERALL = Limit(burst=100, interval_s=1.0)
# A success vouches for its address against the overall limit this long (the dashboard's
# session lifetime: an operator who logged in today keeps working through an attack).
TRUSTED_FOR_S = 12 * 3600.0
# Hard bounds on what the throttle keeps (about 100 bytes an entry). The overall limit
# keeps the failing keys under OVERALL.burst + PER_KEY.window_s / OVERALL.interval_s
# (700) when callers check before they try; trusted keys need a valid token each.
MAX_KEYS = 10_000
MAX_TRUSTED = 10_000
# The overall lock-out's log line at most this often (it can last as long as an attack).
LOG_EVERY_S = 60.0


class Throttled(errors.Busy):
    """Too many failed attempts: try again after `retry_after_s` seconds.

    A Busy, so the gRPC table already answers RESOURCE_EXHAUSTED; HTTP answers 429 with
    a Retry-After header of `retry_after_s`.
    """

    def __init__(self, wait_s: float, scope: str) -> None:
        self.wait_s, self.scope = wait_s, scope
        where = "from your address" if scope == "key" else "from many addresses"
        super().__init__(f"too many failed attempts {where}: try again in {self.retry_after_s} s")

    @property
    def retry_after_s(self) -> int:
        """Return the wait in whole seconds, rounded up (what Retry-After carries)."""
        return max(1, math.ceil(self.wait_s))


class Throttle:
    """Counts failed attempts per key and overall; thread-safe; times from `clock`.

    Checking and recording are separate steps, so attempts already in flight when a key
    fills its bucket still finish and count: a key can overshoot its burst by as many
    attempts as the server runs at once (the dashboard's 8 threads), never more.
    """

    def __init__(
        self,
        *,
        name: str = "login",
        per_key: Limit = PER_KEY,
        overall: Limit = OVERALL,
        trusted_for_s: float = TRUSTED_FOR_S,
        max_keys: int = MAX_KEYS,
        max_trusted: int = MAX_TRUSTED,
        clock: Callable[[], float] = time.monotonic,
        spare_new_keys: bool = False,
        counts: type[errors.SkiffError] = errors.Unauthenticated,
    ) -> None:
        """Count failures per key and overall; see the module docstring.

        With `spare_new_keys`, a key with no recent failure is never held back by the
        overall limit (Enroll: a new device's good token must not wait on others' guesses;
        a guesser's fresh address gets one guess before the overall limit holds it too).
        """
        self.name, self.per_key, self.overall = name, per_key, overall
        self._spare_new, self._counts = spare_new_keys, counts
        self._trusted_for, self._clock = trusted_for_s, clock
        self._max_keys, self._max_trusted = max_keys, max_trusted
        self._lock = threading.Lock()
        # key -> when its bucket is empty ("theoretical arrival time"), oldest failure first.
        self._failing: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._overall_empty_at = -math.inf
        self._overall_told_at = -math.inf
        # key -> until when its last success vouches for it, oldest first.
        self._trusted: collections.OrderedDict[str, float] = collections.OrderedDict()

    def check(self, key: str) -> float | None:
        """Return None if `key` may try now, else the seconds it must wait first."""
        refused = self._refusal(key)
        return None if refused is None else refused[0]

    def failed(self, key: str) -> None:
        """Record a failed attempt by `key` (a wrong token)."""
        with self._lock:
            now = self._clock()
            self._forget(now)
            empty_at = max(self._failing.pop(key, now), now) + self.per_key.interval_s
            self._failing[key] = empty_at
            while len(self._failing) > self._max_keys:
                self._failing.popitem(last=False)
            self._overall_empty_at = max(self._overall_empty_at, now) + self.overall.interval_s
            key_wait = _wait(empty_at, now, self.per_key)
            overall_full = _wait(self._overall_empty_at, now, self.overall) > 0
            tell_overall = overall_full and now >= self._overall_told_at + LOG_EVERY_S
            if tell_overall:
                self._overall_told_at = now
        # Logged as a lock-out starts (refusals are not logged), so an address makes at
        # most one line per PER_KEY.interval_s; the overall line is rate-limited itself.
        if key_wait > 0:
            log.warning("%s: %r failed too often; refusing it for %.0f s", self.name, key, key_wait)
        if tell_overall:
            log.warning(
                "%s: more than %d failures from many addresses; refusing all but recently "
                "successful ones, one failure per %g s",
                self.name,
                self.overall.burst,
                self.overall.interval_s,
            )

    def succeeded(self, key: str) -> None:
        """Record a successful attempt: `key` is exempt from the overall limit for a while."""
        with self._lock:
            now = self._clock()
            self._trusted.pop(key, None)
            self._trusted[key] = now + self._trusted_for
            while self._trusted and (
                len(self._trusted) > self._max_trusted or next(iter(self._trusted.values())) <= now
            ):
                self._trusted.popitem(last=False)

    @contextlib.contextmanager
    def attempt(self, key: str) -> Iterator[None]:
        """Run an attempt by `key`: Throttled before it if `key` must wait.

        The error `counts` names (Unauthenticated by default) out of the block counts as a
        failure, leaving it cleanly as a success; other errors (a malformed request, an
        expired token for a throttle counting UnknownCredential) count as neither.
        """
        refused = self._refusal(key)
        if refused is not None:
            raise Throttled(*refused)
        try:
            yield
        except self._counts:
            self.failed(key)
            raise
        self.succeeded(key)

    def forget(self) -> None:
        """Forget every count (as a restart does): whoever was held back may try again."""
        with self._lock:
            self._failing.clear()
            self._trusted.clear()
            self._overall_empty_at = -math.inf

    def tracked(self) -> int:
        """Return how many keys the throttle holds (failing and trusted)."""
        with self._lock:
            return len(self._failing) + len(self._trusted)

    def _refusal(self, key: str) -> tuple[float, str] | None:
        with self._lock:
            now = self._clock()
            self._forget(now)
            key_wait = _wait(self._failing.get(key, now), now, self.per_key)
            if key_wait > 0:
                return key_wait, "key"
            if self._trusted.get(key, -math.inf) > now:
                return None
            if self._spare_new and key not in self._failing:
                return None
            overall_wait = _wait(self._overall_empty_at, now, self.overall)
            return (overall_wait, "overall") if overall_wait > 0 else None

    def _forget(self, now: float) -> None:
        """Drop drained keys from the front (the oldest failures): amortised O(1)."""
        while self._failing and next(iter(self._failing.values())) <= now:
            self._failing.popitem(last=False)


def enroll_throttle() -> Throttle:
    """Return the throttle of DeviceService.Enroll.

    It counts unknown enrollment tokens only (an expired or used-up one is no guess: a
    factory whose token ran out must not be locked out of its next one), and spares a
    clean address the overall limit (a new device's good token never waits on others).
    """
    return Throttle(name="enroll", spare_new_keys=True, counts=errors.UnknownCredential)


def _wait(empty_at: float, now: float, limit: Limit) -> float:
    """Return how long until a bucket that empties at `empty_at` has room for one more."""
    return empty_at - now - (limit.burst - 1) * limit.interval_s


def client_key(host: str) -> str:
    """Return the throttle key of a client's IP address.

    IPv6 clients are keyed by their /64, the block one host or household is given (a
    single machine can use any address in it); IPv4-mapped addresses as plain IPv4. A
    value that is not an IP address (a Unix socket) is its own key, cut to 100 characters.
    """
    try:
        address = ipaddress.ip_address(host.strip("[]").split("%", 1)[0])
    except ValueError:
        return host[:100]
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


def peer_key(peer: str) -> str:
    """Return the throttle key of a gRPC peer (`context.peer()`: "ipv4:HOST:PORT"...)."""
    scheme, _, rest = peer.partition(":")
    if scheme in ("ipv4", "ipv6"):
        # grpcio percent-encodes an IPv6 peer's brackets: "ipv6:%5B::1%5D:PORT".
        return client_key(urllib.parse.unquote(rest.rpartition(":")[0]))
    return client_key(peer)
