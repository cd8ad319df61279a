"""The failure throttle: per-key and overall limits, Retry-After, trust, bounded memory."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

from contract import errors
from control_plane.api import throttle as mod
from control_plane.api.throttle import Limit, Throttle, Throttled, client_key, peer_key


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def _fail(t: Throttle, key: str, n: int) -> None:
    for _ in range(n):
        assert t.check(key) is None
        t.failed(key)


def test_a_key_gets_its_burst_then_one_try_per_interval(clock):
    t = Throttle(clock=clock)
    _fail(t, "10.0.0.1", mod.PER_KEY.burst)
    assert t.check("10.0.0.1") == pytest.approx(mod.PER_KEY.interval_s)
    clock.now += mod.PER_KEY.interval_s - 1
    assert t.check("10.0.0.1") == pytest.approx(1.0)
    clock.now += 1
    assert t.check("10.0.0.1") is None  # the lock-out ends after exactly Retry-After
    t.failed("10.0.0.1")
    assert t.check("10.0.0.1") == pytest.approx(mod.PER_KEY.interval_s)
    clock.now += mod.PER_KEY.window_s + mod.PER_KEY.interval_s  # quiet: the bucket drains
    _fail(t, "10.0.0.1", mod.PER_KEY.burst)
    assert t.check("10.0.0.1") is not None


def test_refused_attempts_do_not_extend_the_lock_out(clock):
    t = Throttle(clock=clock)
    _fail(t, "k", mod.PER_KEY.burst)
    waits = [t.check("k") for _ in range(300)]
    assert waits == [pytest.approx(mod.PER_KEY.interval_s)] * 300


def test_successes_consume_nothing_and_do_not_unlock(clock):
    t = Throttle(clock=clock)
    for _ in range(1000):
        t.succeeded("k")
    _fail(t, "k", mod.PER_KEY.burst)  # all ten still free
    t.succeeded("k")  # a valid token between guesses buys no more guesses
    assert t.check("k") == pytest.approx(mod.PER_KEY.interval_s)


def test_one_key_locked_out_leaves_another_alone(clock):
    t = Throttle(clock=clock)
    _fail(t, "10.0.0.1", mod.PER_KEY.burst)
    assert t.check("10.0.0.1") is not None
    _fail(t, "10.0.0.2", mod.PER_KEY.burst)  # its own ten
    assert t.check("10.0.0.3") is None


def test_the_overall_limit_stops_a_distributed_guesser(clock):
    t = Throttle(clock=clock)
    spread = mod.PER_KEY.burst - 1  # each address stays under its own limit
    keys = [f"10.1.{i // 256}.{i % 256}" for i in range(mod.OVERALL.burst // spread + 1)]
    failures = 0
    for key in keys:
        for _ in range(spread):
            if t.check(key) is None:
                t.failed(key)
                failures += 1
    assert failures == mod.OVERALL.burst
    wait = t.check("192.0.2.7")  # a new address that never failed
    assert wait == pytest.approx(mod.OVERALL.interval_s)
    with pytest.raises(Throttled) as refused, t.attempt("192.0.2.7"):
        pytest.fail("the attempt ran")
    assert refused.value.scope == "overall" and "many addresses" in str(refused.value)
    clock.now += mod.OVERALL.interval_s  # drains one failure a second
    assert t.check("192.0.2.7") is None


def test_a_recent_success_vouches_against_the_overall_limit_only(clock):
    t = Throttle(clock=clock, overall=Limit(burst=5, interval_s=1.0), trusted_for_s=3600)
    t.succeeded("ops")
    for i in range(5):
        t.failed(f"bot{i}")
    assert t.check("newcomer") is not None
    assert t.check("ops") is None  # the overall lock-out does not reach it
    _fail(t, "ops", mod.PER_KEY.burst)  # its own failures still count against it
    assert t.check("ops") == pytest.approx(mod.PER_KEY.interval_s)
    clock.now += 3600 + mod.PER_KEY.window_s  # trust ends; its bucket drained
    for i in range(5):
        t.failed(f"bot{i}")
    assert t.check("ops") is not None


def test_attempt_counts_wrong_tokens_only(clock):
    t = Throttle(clock=clock, per_key=Limit(burst=2, interval_s=30.0))
    with pytest.raises(errors.InvalidArgument), t.attempt("k"):
        raise errors.InvalidArgument("malformed")  # not a guess
    with t.attempt("k"):
        pass
    for _ in range(2):
        with pytest.raises(errors.Unauthenticated), t.attempt("k"):
            raise errors.Unauthenticated("invalid token")
    ran = []
    with pytest.raises(Throttled) as refused, t.attempt("k"):
        ran.append(True)
    assert not ran  # the token is not even checked
    assert refused.value.retry_after_s == 30 and refused.value.scope == "key"
    assert isinstance(refused.value, errors.Busy)  # RESOURCE_EXHAUSTED in the gRPC table


def test_retry_after_rounds_up_to_whole_seconds(clock):
    t = Throttle(clock=clock, per_key=Limit(burst=1, interval_s=2.5))
    t.failed("k")
    clock.now += 0.1
    with pytest.raises(Throttled) as refused, t.attempt("k"):
        pass
    assert refused.value.wait_s == pytest.approx(2.4) and refused.value.retry_after_s == 3


def test_memory_stays_bounded_under_address_spraying(clock):
    t = Throttle(clock=clock)
    tried = 0
    for i in range(100_000):
        key = f"2001:db8:{i:x}::1"
        if t.check(key) is None:
            t.failed(key)
            tried += 1
        clock.now += 0.001  # a hundred seconds of spraying in all
    # The overall limit admitted its burst plus one a second, so few keys to hold.
    assert tried == pytest.approx(mod.OVERALL.burst + 100, abs=2)
    # Of those, only the last minute's are held: one failure drains in PER_KEY.interval_s.
    held = mod.PER_KEY.interval_s / mod.OVERALL.interval_s
    assert t.tracked() == pytest.approx(held, abs=2)
    clock.now += mod.PER_KEY.window_s
    t.failed("last")
    assert t.tracked() == 1  # drained keys are forgotten


def test_the_hard_caps_hold_for_callers_that_do_not_check(clock):
    t = Throttle(
        clock=clock,
        per_key=Limit(burst=2, interval_s=60.0),
        overall=Limit(burst=1_000_000, interval_s=1.0),
        max_keys=50,
        max_trusted=20,
    )
    for i in range(10_000):
        t.failed(f"a{i}")
        t.succeeded(f"b{i}")
    assert t.tracked() == 50 + 20
    t.failed("a9999")  # kept (among the newest): its second failure locks it out
    assert t.check("a9999") is not None
    t.failed("a0")  # dropped long ago: this is its first failure again
    assert t.check("a0") is None


def test_concurrent_failures_are_all_counted(clock):
    big = Limit(burst=10_000, interval_s=1.0)
    t = Throttle(clock=clock, per_key=big, overall=big)
    start = threading.Barrier(8)

    def hammer():
        start.wait()
        for _ in range(1000):
            t.failed("k")

    threads = [threading.Thread(target=hammer) for _ in range(8)]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so an unlocked update would be lost
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(switch)
    assert t.check("k") is None  # 8,000 of 10,000
    for _ in range(2000):
        t.failed("k")
    assert t.check("k") == pytest.approx(1.0)


def test_a_lock_out_is_logged_once_not_per_refusal(clock, caplog):
    t = Throttle(clock=clock, name="dashboard login")
    with caplog.at_level(logging.WARNING, logger=mod.__name__):
        _fail(t, "10.0.0.1", mod.PER_KEY.burst)
        for _ in range(100):
            t.check("10.0.0.1")
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["dashboard login: '10.0.0.1' failed too often; refusing it for 60 s"]


@pytest.mark.parametrize(
    ("host", "key"),
    [
        ("192.0.2.1", "192.0.2.1"),
        ("::ffff:192.0.2.1", "192.0.2.1"),
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:bbbb::9", "2001:db8:1:2::/64"),  # same /64, same key
        ("[2001:db8::1]", "2001:db8::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("unix-socket", "unix-socket"),
        ("x" * 500, "x" * 100),
    ],
)
def test_client_keys(host, key):
    assert client_key(host) == key


@pytest.mark.parametrize(
    ("peer", "key"),
    [
        ("ipv4:192.0.2.1:50123", "192.0.2.1"),
        ("ipv6:[2001:db8:1:2::7]:50123", "2001:db8:1:2::/64"),
        ("ipv6:[::ffff:192.0.2.1]:443", "192.0.2.1"),
        # What grpcio really writes (brackets percent-encoded): keyed by /64 all the same.
        ("ipv6:%5B2001:db8:1:2::7%5D:50123", "2001:db8:1:2::/64"),
        ("ipv6:%5B2001:db8:1:2::8%5D:50124", "2001:db8:1:2::/64"),
        ("ipv6:%5B::1%5D:7543", "::/64"),
        ("unix:/run/skiff.sock", "unix:/run/skiff.sock"),
    ],
)
def test_grpc_peer_keys(peer, key):
    assert peer_key(peer) == key


def test_a_key_that_never_failed_is_spared_the_overall_limit_when_asked():
    """Enroll: others' guesses fill the overall bucket; a new device's good token from a
    clean address still gets through, while a guessing address gets one try, then waits."""
    now = [0.0]
    enroll = Throttle(
        name="enroll",
        per_key=Limit(10, 60.0),
        overall=Limit(5, 1.0),
        spare_new_keys=True,
        clock=lambda: now[0],
    )
    for i in range(20):
        if enroll.check(f"10.0.0.{i}") is None:
            enroll.failed(f"10.0.0.{i}")
    assert enroll.check("10.0.0.1") is not None  # failed before: the overall limit holds it
    assert enroll.check("192.0.2.50") is None  # never failed: spared
    login = Throttle(per_key=Limit(10, 60.0), overall=Limit(5, 1.0), clock=lambda: now[0])
    for i in range(20):
        if login.check(f"10.0.0.{i}") is None:
            login.failed(f"10.0.0.{i}")
    assert login.check("192.0.2.50") is not None  # the login keeps the stricter default


def test_limits_are_validated():
    with pytest.raises(ValueError, match="burst >= 1"):
        Limit(burst=0, interval_s=1.0)
    with pytest.raises(ValueError, match="interval_s > 0"):
        Limit(burst=1, interval_s=0.0)
