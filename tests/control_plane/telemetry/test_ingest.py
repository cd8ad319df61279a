"""The group-commit writer: one transaction per group, each caller its own answer."""

from __future__ import annotations

import threading

import pytest

from control_plane import errors
from control_plane.telemetry.ingest import ReportWriter


class SlowStore:
    """Stores nothing until let go; records the groups it was given."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.groups: list[list[str]] = []

    def add_reports(self, batches):
        self.go.wait(10)
        self.groups.append([b for b in batches])
        return [errors.NotFound("no such device") if b == "ghost" else True for b in batches]


def test_waiting_batches_go_in_one_group_and_each_caller_hears_its_own_result():
    store = SlowStore()
    writer = ReportWriter(store)
    try:
        first = writer.submit("a")  # taken at once; the writer waits in the store
        while not store.groups and not first.running():
            pass
        rest = [writer.submit(x) for x in ("b", "ghost", "c")]
        store.go.set()
        assert first.result(5) is True
        assert rest[0].result(5) is True and rest[2].result(5) is True
        with pytest.raises(errors.NotFound):
            rest[1].result(5)
        assert store.groups == [["a"], ["b", "ghost", "c"]]
    finally:
        writer.close()


def test_a_caller_that_goes_away_does_not_stop_the_writer():
    store = SlowStore()
    writer = ReportWriter(store)
    try:
        first = writer.submit("a")
        while not first.running():
            pass
        gone = writer.submit("b")
        assert gone.cancel()  # the RPC was cancelled while its batch waited
        store.go.set()
        assert first.result(5) is True
        assert writer.submit("c").result(5) is True  # the writer is still there
        assert store.groups == [["a"], ["c"]]
    finally:
        writer.close()


def test_a_closed_writer_refuses_new_batches():
    writer = ReportWriter(SlowStore())
    writer.close()
    with pytest.raises(errors.Unavailable):
        writer.submit("a")
