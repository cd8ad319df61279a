"""Requests from an asyncio loop: the worker's reply awaited on the loop, no thread hop.

`Model.run_async` (the agent's local API uses it) must answer exactly as `run` does, fall
back to `run` in a thread whenever the direct way cannot go at once, and leave the worker
sound when its caller goes away midway.
"""

from __future__ import annotations

import asyncio
import os
import socket

import numpy as np
import pytest

from runtime import _wire
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


def test_run_async_answers_as_run_does_and_steps_aside_when_the_worker_is_busy(model_fd):
    worker = WorkerExecutor(model_fd, CPU_1)

    async def go():
        x = x16(seed=4, batch=3)["x"]
        direct = await worker.run_async([x], False)
        np.testing.assert_array_equal(direct["y"], worker.run([x], False)["y"])
        with worker._lock:  # another request holds the worker: nothing is sent
            assert await worker.run_async([x], False) is None
        big = x16(seed=4, batch=20_000)["x"]  # 1.3 MB: sent from a thread, not the loop
        assert await worker.run_async([big], False) is None
        with pytest.raises(InvalidInput, match="cannot run these shapes"):
            await worker.run_async([np.zeros((1, 17), np.float32)], False)

    try:
        asyncio.run(go())
        assert worker.restarts == 0
    finally:
        worker.close()


def test_a_caller_gone_midway_leaves_the_worker_up_and_its_reply_to_no_one(model_fd):
    worker = WorkerExecutor(model_fd, CPU_1)

    async def go():
        slow = x16(seed=5, batch=15_000)["x"]  # under the direct path's size limit
        before = worker._seq
        task = asyncio.create_task(worker.run_async([slow], False))
        await asyncio.sleep(0)  # sent; now waiting for the reply
        assert worker._seq == before + 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        x = x16(seed=6)["x"]
        # The abandoned reply is read and dropped in a thread: this request waits its
        # turn (in a thread) and gets its own answer, from the same worker.
        answer = await asyncio.get_running_loop().run_in_executor(None, worker.run, [x], True)
        return x, answer

    pid = worker.pid
    try:
        x, answer = asyncio.run(go())
        with Model.from_bytes(tiny_mnn(), config=CPU_1) as local:
            np.testing.assert_array_equal(answer["y"], local.run({"x": x})["y"])
        assert worker.pid == pid and worker.restarts == 0
    finally:
        worker.close()


def test_a_crash_on_the_direct_path_counts_and_the_next_request_waits_for_the_restart():
    options = {"config": CPU_1, "isolation": Isolation.WORKER, "_fault": Fault("segv")}
    with Model.from_bytes(tiny_mnn(), **options) as model:
        inputs = x16(seed=7)

        async def go():
            with pytest.raises(WorkerCrashed, match="SIGSEGV"):
                await model.run_async(inputs)
            return await model.run_async(inputs)  # restarting: in a thread, it waits

        with pytest.raises(WorkerCrashed):  # the replacement faults on its first run too
            asyncio.run(go())
        assert len(model.crashes) == 2


def test_run_async_in_process_and_in_a_worker_give_runs_answers():
    inputs = x16(seed=8, batch=2)

    async def both(model):
        return await model.run_async(inputs), model.run(inputs)

    for isolation in (Isolation.IN_PROCESS, Isolation.WORKER):
        with Model.from_bytes(tiny_mnn(), config=CPU_1, isolation=isolation) as model:
            got, expected = asyncio.run(both(model))
            np.testing.assert_array_equal(got["y"], expected["y"])
            nan = {"x": np.full((1, 16), np.nan, np.float32)}
            with pytest.raises(InvalidInput, match="NaN"):
                asyncio.run(model.run_async(nan))


def test_a_frame_is_ready_only_once_all_of_it_arrived():
    left, right = socket.socketpair()
    sender, receiver = _wire.Channel(left), _wire.Channel(right)
    try:
        assert not receiver.frame_ready()
        payload = {"x": np.arange(1000, dtype=np.float32)}
        sender.send({"op": "run"}, payload, seq=9)
        assert receiver.frame_ready()
        frame = receiver.recv()
        assert frame.seq == 9 and np.array_equal(frame.arrays["x"], payload["x"])
        left.sendall(b"\x10\x00\x00\x00")  # a prefix cut short
        assert not receiver.frame_ready()
    finally:
        sender.close()
        receiver.close()
