"""The cyclic garbage collector kept to what a server makes as it serves.

`objects_so_far_kept`: a serving process's full collections walked every object it had
built to start (its modules, schema and handlers, some 130k) over and over: under Report
load (bench/telemetry.py --quick) about 20 full collections in each database's run,
2.1-2.3 s of the server's CPU. Those objects live as long as the process, so once it
serves they are left out of every later collection (gc.freeze): 1.3-1.5 s, and 0.65-0.70 s
once reported histograms' buckets stopped being lists the collector tracks (a tuple of
pairs: control_plane.api.telemetry_convert).

`collector_held`: a bulk read's tuples are not collected while the read runs. A health
view reads some 20k device rows as the driver's tuples and turns them into columns
(control_plane.store.sql_device_table); while they pile up the collector runs every 700
of them and, now and then, a full collection that walks every object of the process:
88 ms each in bench/telemetry.py's health view, one in every three or four views, 25 ms
of its ~215 ms on average. None of those tuples can be part of a cycle, and all of them
are freed by reference counting before the read returns. Other threads' garbage waits
meanwhile: reads that overlap one another for longer than MAX_HOLD_S get a collection
as each of them ends, so the collector is never kept off for long however many there
are. For server threads: a KeyboardInterrupt between the collector's switch and the
count of holds could leave it off (serve() handles SIGINT itself), and a gc.disable() by
other code while a read is under way is undone when the last read ends.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

MAX_HOLD_S = 1.0  # overlapping reads: a collection at the end of each past this
_clock = time.monotonic  # a test's to replace

_lock = threading.Lock()
_holds = 0  # reads under way (server threads read at once)
_resume = False  # whether the collector was enabled when the first of them began
_since = 0.0  # when the collector was last held off, or last made to catch up


def objects_so_far_kept() -> None:
    """Leave every object alive now out of all later collections (a server, once built).

    Garbage first: what a collection would free now is freed, not kept for good. Frozen
    objects are still freed when nothing refers to them any more; only a cycle among
    them would now stay.
    """
    gc.collect()
    gc.freeze()


@contextmanager
def collector_held() -> Iterator[None]:
    """Hold the cyclic collector off until this read and every other one under way end."""
    global _holds, _resume, _since
    with _lock:
        if _holds == 0:
            _resume = gc.isenabled()
            gc.disable()
            _since = _clock()
        _holds += 1
    try:
        yield
    finally:
        with _lock:
            _holds -= 1
            if _holds == 0 and _resume:
                gc.enable()
            catch_up = _holds > 0 and _resume and _clock() - _since > MAX_HOLD_S
            if catch_up:
                _since = _clock()
        if catch_up:  # outside the lock: finalizers run Python code, which may read too
            gc.collect()
