"""Batches in one round trip to the worker: the same answers as one run each, in order.

`WorkerExecutor.run_batch` sends several requests' inputs in one frame; the worker answers
them in frames as it goes. These tests hold it to `run`: same outputs bit for bit (big
tensors too), each item's own error, a crash failing what it had not answered, and the
deadline bounding each wait for progress rather than the whole batch.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from runtime.errors import InvalidInput, WorkerCrashed
from runtime.mnn_host import sealed_memfd
from runtime.model import Isolation, Model
from runtime.worker import Fault, WorkerExecutor
from tests.runtime._model_helpers import CPU_1, tiny_mnn, x16


@pytest.fixture
def model_fd():
    fd = sealed_memfd(tiny_mnn())
    yield fd
    os.close(fd)


def test_a_batch_gives_each_item_what_a_run_gives_it_in_order(model_fd):
    worker = WorkerExecutor(model_fd, CPU_1)
    try:
        items = [([x16(seed=i, batch=1 + i % 3)["x"]], False) for i in range(40)]
        answers = worker.run_batch(items)
        assert len(answers) == 40
        for (arrays, exact), answer in zip(items, answers, strict=True):
            np.testing.assert_array_equal(answer["y"], worker.run(arrays, exact)["y"])
        assert worker.run_batch([]) == []
    finally:
        worker.close()


def test_a_big_tensor_round_trips_exactly_alone_and_in_a_batch(model_fd):
    big = x16(seed=7, batch=200_000)  # 12.8 MB in, beyond the frame scratch buffer
    with Model.from_bytes(tiny_mnn(), config=CPU_1) as local:
        expected = local.run(big)["y"]
    worker = WorkerExecutor(model_fd, CPU_1)
    try:
        np.testing.assert_array_equal(worker.run([big["x"]], False)["y"], expected)
        small = x16(seed=1)["x"]
        answers = worker.run_batch([([small], True), ([big["x"]], False), ([small], True)])
        np.testing.assert_array_equal(answers[1]["y"], expected)
        np.testing.assert_array_equal(answers[0]["y"], answers[2]["y"])
    finally:
        worker.close()


def test_a_bad_item_fails_alone_and_the_rest_of_the_batch_runs():
    with Model.from_bytes(tiny_mnn(), config=CPU_1, isolation=Isolation.WORKER) as model:
        good = x16(seed=2)
        nan = {"x": np.full((1, 16), np.nan, np.float32)}
        wrong = {"x": np.zeros((1, 17), np.float32)}  # MNN refuses this shape
        answers = model.run_batch([good, nan, wrong, good])
        assert isinstance(answers[1], InvalidInput) and "NaN" in str(answers[1])
        assert isinstance(answers[2], InvalidInput), answers[2]
        expected = model.run(good)["y"]
        for answer in (answers[0], answers[3]):
            np.testing.assert_array_equal(answer["y"], expected)


def test_a_crash_midway_fails_what_it_interrupted_and_counts_once():
    fault = Fault("segv", on_request=3)
    options = {"config": CPU_1, "isolation": Isolation.WORKER, "_fault": fault}
    with Model.from_bytes(tiny_mnn(), **options) as model:
        batch = [x16(seed=i) for i in range(5)]
        answers = model.run_batch(batch)
        crash = answers[2]
        assert isinstance(crash, WorkerCrashed) and crash.event.signal == "SIGSEGV"
        assert all(a is crash for a in answers[3:])
        # Answers are sent every few milliseconds: the two before may not have left yet.
        assert all(isinstance(a, dict) or a is crash for a in answers[:2])
        assert len(model.crashes) == 1
        again = model.run_batch(batch[:2])  # a fresh worker (its third run will fault)
    with Model.from_bytes(tiny_mnn(), config=CPU_1) as local:
        expected = [local.run(inputs)["y"] for inputs in batch[:2]]
        for new, y in zip(again, expected, strict=True):
            np.testing.assert_array_equal(new["y"], y)


def test_the_deadline_bounds_each_wait_for_progress_not_the_whole_batch(model_fd):
    # Each wait for the next frame of answers takes milliseconds; 3 s leaves a loaded CI
    # machine room to stall one (at 1 s, one did, and the worker was killed).
    worker = WorkerExecutor(model_fd, CPU_1, deadline_s=3.0)
    try:
        x = x16(seed=3)["x"]
        # Batches grow until one takes longer than the deadline in all (~2.5 deadlines
        # from the last one's pace): sized from one timing, a batch came out too short
        # when the machine was busy while it was timed and idle after.
        count, took = 1000, 0.0
        while took <= worker.deadline_s and count < 200_000:
            if took:
                count = min(200_000, max(2 * count, int(2.5 * worker.deadline_s / took * count)))
            start = time.monotonic()
            answers = worker.run_batch([([x], True)] * count)
            took = time.monotonic() - start
            failed = [a for a in answers if not isinstance(a, dict)]
            assert not failed and worker.restarts == 0, failed[:1]
        assert took > worker.deadline_s or count == 200_000
        np.testing.assert_array_equal(answers[-1]["y"], worker.run([x], True)["y"])
    finally:
        worker.close()


def test_a_batch_in_process_gives_the_same_answers():
    batch = [x16(seed=i) for i in range(4)]
    with Model.from_bytes(tiny_mnn(), config=CPU_1) as local:
        answers = local.run_batch(batch)
        for inputs, answer in zip(batch, answers, strict=True):
            np.testing.assert_array_equal(answer["y"], local.run(inputs)["y"])
