"""LlmServing without a model: its queue, version swaps and crash counting, on a fake worker.

The real worker and agent are exercised in test_llm_generate.py; here every timing is
driven by events, so each rule is checked exactly.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import pytest

from device_agent.llm_serving import QUEUE, Busy, GenerateRequest, LlmServing
from device_agent.report_outbox import Collector
from device_agent.serving import ROLLBACK_CRASHES, NotServing
from runtime.llm import StopReason, Summary

DONE = Summary(
    tokens_in=3,
    tokens_out=5,
    ttft_s=0.02,
    prefill_tps=150.0,
    decode_tps=40.0,
    stop_reason=StopReason.MAX_TOKENS,
)


@dataclass
class _Delta:
    text: str
    summary: object = None


class FakeWorker:
    """Streams two deltas; `gate` (when set) holds the first until released."""

    def __init__(self, name: str, gate: threading.Event | None = None, crash: bool = False):
        self.name, self.gate, self.crash = name, gate, crash
        self.closed = False
        self.started = threading.Event()

    def apply_chat_template(self, messages):
        return "chat:" + messages[-1]["content"]

    def encode(self, text):
        return [1, 2, 3]

    def generate(self, ids, **_):
        self.started.set()
        if self.gate is not None:
            assert self.gate.wait(30)
        if self.crash:
            from runtime.backends import Backend, BackendConfig
            from runtime.errors import WorkerCrashed
            from runtime.events import CrashEvent

            config = BackendConfig(Backend.CPU, "low", 1, "low")
            raise WorkerCrashed(CrashEvent(config=config, reason="signal", signal="SIGSEGV"))
        yield _Delta(self.name)
        yield _Delta("", summary=DONE)

    def close(self):
        self.closed = True


def _info(version: int) -> dict:
    return {
        "version": version,
        "variant": "q4",
        "uid": f"u{version}",
        "config": "CPU/low/t4/mem-low",
    }


def _run(serving: LlmServing, out: list, name: str = "m") -> threading.Thread:
    def body() -> None:
        try:
            out.extend(serving.generate(name, GenerateRequest(prompt="hi"), lambda: False))
        except Exception as exc:  # noqa: BLE001 - the test reads it
            out.append(exc)

    thread = threading.Thread(target=body)
    thread.start()
    return thread


def test_a_new_version_swaps_in_between_generations_and_the_old_closes_after():
    serving = LlmServing(Collector())
    gate = threading.Event()
    old = FakeWorker("old", gate)
    serving.put("m", _info(1), old)
    first: list = []
    running = _run(serving, first)
    assert old.started.wait(30)
    new = FakeWorker("new")
    serving.put("m", _info(2), new)  # while v1 generates
    assert not old.closed  # still in use
    gate.set()
    running.join(30)
    assert [t for t, *_ in first] == ["old", ""]
    assert old.closed
    assert [t for t, *_ in serving.generate("m", GenerateRequest(prompt="x"), lambda: False)] == [
        "new",
        "",
    ]
    assert serving.serving("m")["version"] == 2


def test_beyond_the_queue_a_request_is_refused_at_once():
    serving = LlmServing(Collector())
    gate = threading.Event()
    worker = FakeWorker("w", gate)
    serving.put("m", _info(1), worker)
    outs = [[] for _ in range(QUEUE + 1)]
    threads = [_run(serving, outs[0])]
    assert worker.started.wait(30)
    threads += [_run(serving, out) for out in outs[1:]]
    # Wait until the queue is full (its waiters are counted before they block).
    for _ in range(3000):
        with serving._lock:
            if serving._models["m"].waiting == QUEUE:
                break
        threading.Event().wait(0.01)
    with pytest.raises(Busy, match="already waiting"):
        list(serving.generate("m", GenerateRequest(prompt="x"), lambda: False))
    gate.set()
    for t in threads:
        t.join(30)
    assert all(out and out[-1][1] is DONE for out in outs)


def test_a_waiting_caller_that_gives_up_leaves_the_queue():
    serving = LlmServing(Collector())
    gate = threading.Event()
    serving.put("m", _info(1), FakeWorker("w", gate))
    first: list = []
    running = _run(serving, first)
    gone = threading.Event()
    gone.set()
    assert list(serving.generate("m", GenerateRequest(prompt="x"), gone.is_set)) == []
    with serving._lock:
        assert serving._models["m"].waiting == 0
    gate.set()
    running.join(30)


def test_repeated_crashes_ask_for_a_rollback_once():
    failures = []
    serving = LlmServing(Collector(), lambda *a: failures.append(a))
    serving.put("m", _info(1), FakeWorker("w", crash=True))
    from runtime.errors import WorkerCrashed

    for _ in range(ROLLBACK_CRASHES + 1):
        with pytest.raises(WorkerCrashed):
            list(serving.generate("m", GenerateRequest(prompt="x"), lambda: False))
    assert len(failures) == 1
    assert failures[0][:2] == ("m", "u1") and "SIGSEGV" in failures[0][2]


def test_an_unknown_or_dropped_model_is_not_served():
    serving = LlmServing(Collector())
    with pytest.raises(NotServing, match="not installed"):
        list(serving.generate("m", GenerateRequest(prompt="x"), lambda: False))
    worker = FakeWorker("w")
    serving.put("m", _info(1), worker)
    serving.drop("m")
    assert worker.closed and serving.serving("m") is None


def test_each_generation_reports_tokens_first_token_time_and_decode_speed():
    collector = Collector()
    serving = LlmServing(collector)
    serving.put("m", _info(1), FakeWorker("w"))
    for _ in range(2):
        assert list(serving.generate("m", GenerateRequest(prompt="x"), lambda: False))
    # A caller that leaves mid-stream: its generation is counted as cancelled.
    stream = serving.generate("m", GenerateRequest(prompt="x"), lambda: False)
    next(stream)
    stream.close()
    (stats,) = collector.cut().models
    assert (stats.model, stats.version, stats.variant, stats.config) == (
        "m",
        1,
        "q4",
        "CPU/low/t4/mem-low",
    )
    assert stats.inferences == 3 and stats.errors == 0 and stats.cancellations == 1
    assert (stats.tokens_in, stats.tokens_out) == (6, 10)  # the cancelled one had no summary
    assert stats.ttft.count == 2 and stats.ttft.min_ns == 20_000_000
    # Latency is decode time per token: 1/40 s.
    assert stats.latency.count == 2 and stats.latency.min_ns == 25_000_000


def test_a_crash_is_reported_with_its_signal():
    collector = Collector()
    serving = LlmServing(collector)
    serving.put("m", _info(1), FakeWorker("w", crash=True))
    from runtime.errors import WorkerCrashed

    with pytest.raises(WorkerCrashed):
        list(serving.generate("m", GenerateRequest(prompt="x"), lambda: False))
    (stats,) = collector.cut().models
    assert stats.inferences == 1 and stats.errors == 1
    assert [c.signal for c in stats.crashes] == ["SIGSEGV"]
