"""`LlmWorker`: the real SmolLM2 fp16 bundle served from a child process that may crash."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from runtime.errors import (
    DeadlineExceeded,
    ExecutorClosed,
    InvalidInput,
    ModelLoadError,
    WorkerCrashed,
)
from runtime.llm.session import LlmSession, StopReason
from runtime.llm.worker import LlmWorker
from runtime.worker import Fault

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
STORY = [{"role": "user", "content": "Write a long story about a robot who learns to paint."}]


@pytest.fixture(scope="module")
def worker(smollm2_files):
    with LlmWorker(smollm2_files, threads=1) as worker:
        yield worker


def _prompt(worker, messages=QUESTION) -> list[int]:
    return worker.encode(worker.apply_chat_template(messages))


def _replaced(files: dict[str, int], name: str, data: bytes) -> dict[str, int]:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.write(fd, data)
    return {**files, name: fd}


def test_it_streams_the_answer_over_several_deltas(worker, capfd):
    ids = _prompt(worker)
    deltas = list(worker.generate(ids, max_new_tokens=40))
    text, summary = "".join(d.text for d in deltas), deltas[-1].summary
    assert "Paris" in text and "<|im_end|>" not in text
    assert len(deltas) >= 4 and all(d.summary is None for d in deltas[:-1])
    assert summary.stop_reason is StopReason.EOS
    assert summary.tokens_in == len(ids) and summary.tokens_out == len(summary.output_ids)
    assert summary.ttft_s > 0 and summary.prefill_tps > 0 and summary.decode_tps > 0
    assert worker.info.context_length == worker.context_length == 2048
    assert capfd.readouterr().out == ""  # neither MNN nor the child write to our stdout


def test_it_answers_as_the_in_process_session_does(worker, smollm2_files):
    ids = _prompt(worker)
    with LlmSession(smollm2_files, threads=1, precision="low", memory="low") as session:
        assert session.encode(session.apply_chat_template(QUESTION)) == ids
        local = list(session.generate(ids, max_new_tokens=24))
        continuation = list(local[-1].summary.output_ids)
        expected = session.logits(ids, continuation)
    remote = list(worker.generate(ids, max_new_tokens=24))
    assert remote[-1].summary.output_ids == local[-1].summary.output_ids
    assert "".join(d.text for d in remote) == "".join(d.text for d in local)
    rows = worker.logits(ids, continuation)
    assert rows.shape == expected.shape == (len(continuation), 49152)
    np.testing.assert_allclose(rows, expected, rtol=0, atol=1e-4)


def test_argument_errors_are_raised_before_anything_runs(worker):
    with pytest.raises(InvalidInput, match="prompt is empty"):
        worker.generate([], max_new_tokens=4)
    with pytest.raises(InvalidInput, match="outside the vocabulary"):
        worker.generate([1, 49152], max_new_tokens=4)
    with pytest.raises(InvalidInput, match="max_new_tokens"):
        worker.generate([1, 2], max_new_tokens=0)
    with pytest.raises(InvalidInput, match="stop string"):
        worker.generate([1, 2], max_new_tokens=4, stop_strings=[""])
    # Checked in the child, and back with the same type and message:
    with pytest.raises(InvalidInput, match="token id 49152 is outside the vocabulary"):
        worker.logits([1, 2], [49152])
    with pytest.raises(InvalidInput, match="continuation_ids must not be empty"):
        worker.logits([1, 2], [])


def test_chat_errors_come_back_as_invalid_input(worker, smollm2_files):
    with pytest.raises(InvalidInput, match="role must be one of"):
        worker.apply_chat_template([{"role": "robot", "content": "hi"}])
    config = json.loads(os.pread(smollm2_files["llm_config.json"], 1 << 20, 0))
    del config["jinja"]
    files = _replaced(smollm2_files, "llm_config.json", json.dumps(config).encode())
    try:
        with LlmWorker(files) as bare:
            with pytest.raises(InvalidInput, match="no chat template") as raised:
                bare.apply_chat_template(QUESTION)
            with LlmSession(files) as session, pytest.raises(InvalidInput) as local:
                session.apply_chat_template(QUESTION)
            assert str(raised.value) == str(local.value)
    finally:
        os.close(files["llm_config.json"])


def test_cancelling_stops_within_two_tokens_and_the_worker_serves_on(worker):
    flag = [False]
    stream = worker.generate(_prompt(worker, STORY), max_new_tokens=200, cancelled=lambda: flag[0])
    first = next(stream)
    flag[0] = True
    rest = list(stream)
    summary = rest[-1].summary
    assert first.summary is None and summary.stop_reason is StopReason.CANCELLED
    assert summary.tokens_out <= 3  # the first token, and at most two more
    text = "".join(d.text for d in worker.generate(_prompt(worker), max_new_tokens=40))
    assert "Paris" in text


def test_a_consumer_that_stops_reading_stops_the_child(worker, caplog):
    caplog.set_level(logging.DEBUG, logger="runtime")
    stream = worker.generate(_prompt(worker, STORY), max_new_tokens=500)
    next(stream)
    next(stream)
    stream.close()
    (ended,) = [r.getMessage() for r in caplog.records if "abandoned" in r.getMessage()]
    match = re.search(r": cancelled after (\d+) tokens", ended)
    assert match and int(match.group(1)) <= 4  # two read, at most two more
    assert "Paris" in "".join(d.text for d in worker.generate(_prompt(worker), max_new_tokens=40))


def test_callers_wait_their_turn_within_the_queue_deadline(worker, monkeypatch):
    stream = worker.generate(_prompt(worker), max_new_tokens=40)
    next(stream)  # this generation holds the worker until it ends or is closed
    with ThreadPoolExecutor(1) as pool:
        waiter = pool.submit(worker.encode, "hello")  # waits until the generation ends
        text = "".join(d.text for d in stream)
        assert waiter.result(timeout=60) == worker.encode("hello") and "Paris" in text
    monkeypatch.setattr(worker._worker, "queue_deadline_s", 0.2)
    stream = worker.generate(_prompt(worker, STORY), max_new_tokens=100)
    next(stream)
    with pytest.raises(DeadlineExceeded, match="a generation ahead of it still runs"):
        worker.encode("hello")
    stream.close()
    assert worker.encode("hello")


def test_bad_settings_are_refused_before_spawning(smollm2_files):
    with pytest.raises(InvalidInput, match=r"threads must be an integer in \[1, 256\]"):
        LlmWorker(smollm2_files, threads=0)
    with pytest.raises(InvalidInput, match="precision must be one of"):
        LlmWorker(smollm2_files, precision="fp8")


def test_a_killed_child_is_a_crash_and_restarts(smollm2_files, capfd):
    idle_deaths = []
    with LlmWorker(smollm2_files, on_idle_death=idle_deaths.append) as crashy:
        ids = _prompt(crashy)
        first_pid = crashy.pid
        stream = crashy.generate(_prompt(crashy, STORY), max_new_tokens=200)
        next(stream)
        os.kill(first_pid, signal.SIGKILL)
        with pytest.raises(WorkerCrashed, match="killed by SIGKILL") as raised:
            list(stream)
        assert raised.value.event.signal == "SIGKILL" and crashy.pid is None
        crashy.restart()
        assert crashy.restarts == 1 and crashy.pid not in (None, first_pid)
        tmp = crashy._worker._tmp  # the children's TMPDIR: the dead one's load dir is gone
        assert len(os.listdir(tmp)) == 1
        assert "Paris" in "".join(d.text for d in crashy.generate(ids, max_new_tokens=40))
        # Killed between requests (the OOM killer's way): the next request restarts it.
        os.kill(pid := crashy.pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, left for the worker to reap
        assert "Paris" in "".join(d.text for d in crashy.generate(ids, max_new_tokens=40))
        assert crashy.restarts == 2
        assert [(e.signal, e.idle) for e in idle_deaths] == [("SIGKILL", True)]
    assert capfd.readouterr().out == ""
    assert not os.path.exists(tmp)


def test_a_native_crash_names_its_signal_and_last_log_line(smollm2_files):
    with LlmWorker(smollm2_files, fault=Fault("segv", on_request=3)) as crashy:
        ids = _prompt(crashy)
        with pytest.raises(WorkerCrashed, match="SIGSEGV") as raised:
            list(crashy.generate(ids, max_new_tokens=40))
        assert raised.value.event.detail == "skiff worker: injected fault segv"
        # The fault fires on a process's third step: one-step requests are safe.
        last = list(crashy.generate(ids, max_new_tokens=1))[-1]
        assert last.summary.stop_reason is StopReason.MAX_TOKENS


def test_a_hung_step_misses_its_deadline_and_is_killed(smollm2_files):
    with LlmWorker(smollm2_files, step_deadline_s=0.5, fault=Fault("hang", on_request=3)) as hung:
        ids = _prompt(hung)
        stream = hung.generate(ids, max_new_tokens=40)
        with pytest.raises(WorkerCrashed, match="missed its deadline") as raised:
            list(stream)
        assert raised.value.event.reason == "deadline"
        assert hung.encode("hello")  # restarted


def test_closing_ends_a_suspended_generation_and_is_idempotent(smollm2_files):
    closing = LlmWorker(smollm2_files)
    stream = closing.generate(_prompt(closing, STORY), max_new_tokens=200)
    next(stream)
    pid = closing.pid
    closing.close()
    closing.close()
    with pytest.raises(ExecutorClosed):
        list(stream)
    with pytest.raises(ExecutorClosed):
        closing.encode("hello")
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reaped


def test_a_corrupt_graph_is_a_load_error(smollm2_files):
    files = _replaced(smollm2_files, "llm.mnn", b"\0" * 1000)
    try:
        with pytest.raises(ModelLoadError, match="could not load the bundle: ."):
            LlmWorker(files)
    finally:
        os.close(files["llm.mnn"])
