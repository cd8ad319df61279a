"""StreamEngine behaviour beyond equality with the reference: hand-checked firings,
zero-copy output, the GIL released during batches, and bounded memory."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from runtime.stream import Feature, StreamEngine, count, sliding, tumbling

from ._stream_helpers import batch


def shop_engine(**config) -> tuple[StreamEngine, int]:
    engine = StreamEngine(
        event_types=["page_enter", "click", "purchase"],
        key_fields=["item", "page"],
        value_fields=["amount"],
        **config,
    )
    tid = engine.add_trigger(
        "page_enter[page==3] -> click ~> purchase[amount>10]",
        by="item",
        within_ms=1000,
        features=[
            Feature("count", window=sliding(500)),
            Feature("mean", "amount", count(3)),
            Feature("histogram", "amount", tumbling(100), edges=(0, 10, 20)),
            Feature("last", "amount", sliding(1000), of="click"),
        ],
    )
    return engine, tid


def test_hand_checked_firing() -> None:
    engine, tid = shop_engine(lateness_ms=50)
    rows = [
        (100, 0, [7, 3], [0.0]),  # page_enter(page 3)
        (110, 1, [7, 3], [2.0]),  # click, right after: "->" holds
        (120, 1, [7, 4], [4.0]),  # another click (gap allowed before purchase)
        (250, 2, [7, 3], [15.0]),  # purchase > 10: fires
        (240, 2, [7, 3], [5.0]),  # purchase <= 10 (and 10 ms out of order): no
        (260, 2, [8, 3], [50.0]),  # other item: no match
    ]
    firings = engine.push_batch(*batch(rows, 2, 1))
    assert firings.trigger_id.tolist() == [tid]
    assert firings.event_index.tolist() == [3]
    assert firings.key.tolist() == [7]
    # hull of sliding(500) [-249, 251), tumbling(100) [100, 200), sliding(1000) [-749, 251)
    assert (firings.window_start[0], firings.window_end[0]) == (-749, 251)
    # count 4; mean of 4, 2, 15 (last 3 arrivals); bins of [100, 200): 0, 2, 4 -> [3, 0];
    # last click by ts: 4.0
    np.testing.assert_allclose(firings.feature_row(0), [4, 7.0, 3, 0, 4.0])
    assert engine.feature_names(tid)[2:4] == [
        "histogram(amount)@tumbling(100ms)[0,10)",
        "histogram(amount)@tumbling(100ms)[10,20)",
    ]


def test_contiguous_step_needs_the_very_next_event_of_the_key() -> None:
    engine = StreamEngine(event_types=["a", "b", "c"], key_fields=["k"])
    tid = engine.add_trigger("a -> b", by="k")
    rows = [(1, 0, [1], []), (2, 0, [2], []), (3, 1, [1], []), (4, 0, [1], []), (5, 2, [1], [])]
    rows += [(6, 1, [1], [])]
    # Key 1's stream: a b a c b. Other keys' events in between do not break "->".
    firings = engine.push_batch(*batch(rows, 1, 0))
    assert firings.event_index.tolist() == [2]
    assert firings.features(tid).shape == (1, 0)


def test_single_push_equals_batch() -> None:
    one, _ = shop_engine()
    many, _ = shop_engine()
    rows = [(100, 0, [7, 3], [0.0]), (110, 1, [7, 3], [2.0]), (250, 2, [7, 3], [15.0])]
    names = ["page_enter", "click", "purchase"]
    singles = [
        one.push(ts, names[typ], keys={"item": k[0], "page": k[1]}, values=v)
        for ts, typ, k, v in rows
    ]
    whole = many.push_batch(*batch(rows, 2, 1))
    assert [len(f) for f in singles] == [0, 0, 1]
    np.testing.assert_array_equal(singles[2].features(0), whole.features(0))
    assert one.stats() == many.stats()


def test_feature_matrices_are_zero_copy_views() -> None:
    engine, tid = shop_engine()
    rows = [(100, 0, [7, 3], [0.0]), (110, 1, [7, 3], [2.0])]
    rows += [(200 + i, 2, [7, 3], [11.0 + i]) for i in range(50)]
    firings = engine.push_batch(*batch(rows, 2, 1))
    matrix = firings.features(tid)
    assert matrix.shape == (50, 5) and matrix.flags.c_contiguous
    # The array wraps the engine's own buffer (owned by a capsule), not a copy of it.
    assert not matrix.flags.owndata
    assert type(matrix.base).__name__ == "PyCapsule"
    assert firings.features(tid) is matrix
    row = firings.feature_row(7)
    assert np.shares_memory(row, matrix) and row.base is matrix
    assert type(firings.event_index.base).__name__ == "PyCapsule"


def big_batch(n: int, n_keys: int = 1000) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(1)
    return (
        np.arange(n, dtype=np.int64),
        rng.integers(0, 3, n, dtype=np.int32),
        rng.integers(0, n_keys, (n, 2), dtype=np.int64),
        rng.random((n, 1)),
    )


def test_gil_is_released_during_a_batch() -> None:
    engine, _ = shop_engine()
    for i in range(20):  # enough work per event that the batch takes a while
        engine.add_trigger(f"click ~> purchase[amount>{i / 20}]", by="item")
    arrays = big_batch(2_000_000)
    ticks = 0
    done = threading.Event()

    def spin() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1

    # Hand the GIL over more often, so a thread blocked on it is noticed at once.
    old = __import__("sys").getswitchinterval()
    __import__("sys").setswitchinterval(1e-4)
    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        before = ticks
        start = time.perf_counter()
        engine.push_batch(*arrays)
        elapsed = time.perf_counter() - start
        during = ticks - before
    finally:
        done.set()
        spinner.join()
        __import__("sys").setswitchinterval(old)
    assert elapsed > 0.05, "batch too quick to tell"
    # A thread starved of the GIL for the whole batch would barely tick.
    assert during > 10_000, (during, elapsed)


def test_pushes_from_two_threads_are_serialised() -> None:
    engine, _ = shop_engine(lateness_ms=1 << 40)
    arrays = big_batch(200_000)
    threads = [threading.Thread(target=engine.push_batch, args=arrays) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert engine.stats()["events"] == 800_000


def test_max_keys_bounds_live_keys_least_recently_used_first() -> None:
    engine = StreamEngine(event_types=["a"], key_fields=["k"], value_fields=["v"], max_keys=100)
    engine.add_trigger("a ~> a", by="k", features=[Feature("sum", "v", count(10))])
    n = 10_000
    ts = np.arange(n, dtype=np.int64)
    engine.push_batch(ts, np.zeros(n, np.int32), ts.reshape(n, 1), np.ones((n, 1)))
    stats = engine.stats()
    assert stats["live_keys"] == 100 and stats["evicted_keys"] == n - 100
    assert stats["live_events"] == 100  # one event per surviving key
    # Key 9999 is live (fires on its second event); key 0 was evicted (starts afresh).
    again = engine.push_batch(
        np.array([n, n], np.int64),
        np.zeros(2, np.int32),
        np.array([[n - 1], [0]], np.int64),
        np.ones((2, 1)),
    )
    assert again.key.tolist() == [n - 1]
    assert again.features(0)[0, 0] == 2.0


def test_idle_keys_expire_after_ttl() -> None:
    engine = StreamEngine(event_types=["a"], key_fields=["k"], key_ttl_ms=100)
    engine.add_trigger("a ~> a", by="k")
    ts = np.array([0, 1, 50, 200, 201], np.int64)
    keys = np.array([[1], [2], [2], [3], [2]], np.int64)
    firings = engine.push_batch(ts, np.zeros(5, np.int32), keys, np.zeros((5, 0)))
    # Key 2 was last seen at watermark 50; at 201 it had been idle 151 ms > 100: fresh.
    assert firings.event_index.tolist() == [2]
    assert engine.stats()["live_keys"] == 2  # keys 3 and 2; key 1 expired


def test_old_events_are_evicted_from_windows() -> None:
    engine = StreamEngine(event_types=["a"], key_fields=["k"], value_fields=["v"], lateness_ms=50)
    engine.add_trigger(
        "a",
        by="k",
        features=[Feature("sum", "v", sliding(1_000)), Feature("max", "v", count(20))],
    )
    n = 100_000
    ts = np.arange(n, dtype=np.int64)  # one event per ms, one key
    engine.push_batch(ts, np.zeros(n, np.int32), np.zeros((n, 1), np.int64), np.ones((n, 1)))
    stats = engine.stats()
    # Needed: ts within lateness + reach of the watermark (1050 ms of events), 20 for
    # count; logs are trimmed when they have doubled since the last trim.
    assert 1_000 <= stats["live_events"] <= 2 * 1_051 + 16
    assert stats["state_bytes"] < 200_000


@pytest.mark.parametrize("n_triggers", [1, 50])
def test_trie_shares_prefixes(n_triggers: int) -> None:
    engine = StreamEngine(event_types=["a", "b", "c"], key_fields=["k"])
    for i in range(n_triggers):
        engine.add_trigger(f"a -> b ~> c[k=={i}]", by="k")
    engine.push_batch(*batch([], 1, 0))
    assert engine.stats()["trie_nodes"] == 2 + n_triggers
