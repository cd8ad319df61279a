"""The cyclic collector in a server process (control_plane.gc_tuning).

A serving process leaves what it built to start out of every later collection, and a
bulk read of device rows is not interrupted by collections that walk its tuples.
"""

from __future__ import annotations

import gc
import threading

import pytest

from control_plane.gc_tuning import collector_held
from control_plane.home import init_home
from control_plane.settings import load_config
from tests.fresh_interpreter import printed_json


def test_a_serving_process_keeps_what_it_built_out_of_later_collections(tmp_path):
    home = tmp_path / "home"
    init_home(load_config(home, environ={"SKIFF_GRPC": "127.0.0.1:0"}))
    # serve() runs until SIGTERM; a thread tells it once its objects are frozen.
    script = f"""
import gc, json, os, signal, threading, time
from pathlib import Path

from control_plane.serve import serve
from control_plane.settings import load_config

seen = {{}}

def stop_once_frozen():
    deadline = time.monotonic() + 60
    while not gc.get_freeze_count() and time.monotonic() < deadline:
        time.sleep(0.01)
    seen["frozen"] = gc.get_freeze_count()
    seen["enabled"] = gc.isenabled()
    os.kill(os.getpid(), signal.SIGTERM)

before = gc.get_freeze_count()
threading.Thread(target=stop_once_frozen, daemon=True).start()
status = serve(config=load_config(Path({str(home)!r}), environ={{"SKIFF_GRPC": "127.0.0.1:0"}}))
print(json.dumps({{"before": before, "status": status, **seen}}))
"""
    seen = printed_json(script)
    assert seen["before"] == 0, seen
    assert seen["status"] == 0, seen
    # The app's modules, schema and handlers: tens of thousands of objects.
    assert seen["frozen"] > 10_000, seen
    assert seen["enabled"] is True, seen  # frozen objects aside, it still collects


@pytest.fixture
def collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    if was:
        gc.enable()
    else:
        gc.disable()


def test_the_collector_resumes_when_the_last_of_overlapping_reads_ends(collector_on):
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    states = {}

    def first():
        with collector_held():
            first_in.set()
            second_in.wait(10)
        states["after_first"] = gc.isenabled()  # the second read is still under way
        first_out.set()

    def second():
        first_in.wait(10)
        with collector_held():
            second_in.set()
            first_out.wait(10)
            states["inside_second"] = gc.isenabled()

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert states == {"after_first": False, "inside_second": False}
    assert gc.isenabled()


def test_a_collector_switched_off_before_a_read_stays_off(collector_on):
    gc.disable()
    with collector_held():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_read_that_fails_still_resumes_the_collector(collector_on):
    with pytest.raises(RuntimeError), collector_held():
        raise RuntimeError("the database went away")
    assert gc.isenabled()


def test_a_reported_histograms_bucket_pairs_leave_the_collectors_watch():
    """A server holds seconds of batches for its roller: their bucket pairs are tuples of
    ints, which the collector stops tracking once it has seen them (lists it walks in
    every full collection); JSON stores them as before."""
    import json

    from control_plane.api.telemetry_convert import histogram_dict
    from protos import device_pb2
    from runtime.histogram import SCHEME, LatencyHistogram, bucket_of

    low, high = 1_000_000, 9_000_000
    message = device_pb2.LatencyHistogram(
        scheme=SCHEME,
        count=3,
        sum_ns=low + 2 * high,
        min_ns=low,
        max_ns=high,
        bucket_index=[bucket_of(high), bucket_of(low)],
        bucket_count=[2, 1],
    )
    h = histogram_dict(message, "model stats 'm' latency")
    for _ in range(3):  # the pairs, then the tuple of them, then the dict (a full one)
        gc.collect()
    assert h["buckets"] and not any(gc.is_tracked(pair) for pair in h["buckets"])
    assert not gc.is_tracked(h["buckets"]) and not gc.is_tracked(h)
    stored = json.loads(json.dumps(h))
    assert stored["buckets"] == [[bucket_of(low), 1], [bucket_of(high), 2]]
    assert LatencyHistogram.from_dict(h).to_dict() == stored


def test_reads_that_overlap_for_long_let_the_collector_catch_up(collector_on, monkeypatch):
    from control_plane import gc_tuning

    now = [1000.0]
    monkeypatch.setattr(gc_tuning, "_clock", lambda: now[0])
    collections = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            collections.append(now[0])

    gc.callbacks.append(count)
    try:
        with collector_held():  # one read, then a relay of overlapping ones
            previous = collector_held()
            previous.__enter__()
            for _ in range(6):
                now[0] += 0.5
                following = collector_held()
                following.__enter__()
                previous.__exit__(None, None, None)
                previous = following
                assert not gc.isenabled()
            previous.__exit__(None, None, None)
        assert gc.isenabled()
    finally:
        gc.callbacks.remove(count)
    # 3 s held off in all: caught up as the first read past 1 s ended, and again 1.5 s
    # later; never while a read alone is under way, nor as the last one ends.
    assert collections == [1001.5, 1003.0], collections
