"""Hot swap: new versions load while the old one serves; no request fails or mixes versions."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime import swap as swap_module
from runtime.errors import ModelFailed, StaleSwap
from runtime.model import Isolation, Model
from runtime.swap import ModelSlot
from tests.runtime._model_helpers import CPU_1, tiny_mnn, x16

INPUTS = x16(seed=9, batch=2)


@pytest.fixture(scope="module")
def expected() -> dict[str, np.ndarray]:
    """What each version answers to INPUTS (two differently seeded MLPs)."""
    answers = {}
    for version, seed in (("v1", 0), ("v2", 1)):
        with Model.from_bytes(tiny_mnn(seed), config=CPU_1, version=version) as model:
            answers[version] = model.run(INPUTS)["y"]
    assert not np.allclose(answers["v1"], answers["v2"])
    return answers


def _hammer(slot, stop, results, errors, progress):
    while not stop.is_set():
        try:
            answer = slot.run_versioned(INPUTS)
        except Exception as exc:  # noqa: BLE001 - any failure is what the test counts
            errors.append(exc)
            answer = None
        with progress:
            if answer is not None:
                results.append(answer)
            progress.notify_all()


@pytest.mark.parametrize(("isolation", "swaps"), [(Isolation.IN_PROCESS, 6), ("worker", 2)])
def test_swaps_under_load_drop_nothing(expected, isolation, swaps):
    first = Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1", isolation=isolation)
    slot = ModelSlot(first)
    stop, results, errors, progress = threading.Event(), [], [], threading.Condition()
    args = (slot, stop, results, errors, progress)
    threads = [threading.Thread(target=_hammer, args=args) for _ in range(4)]
    for thread in threads:
        thread.start()
    retired = [first]
    try:
        for i in range(swaps):
            version = "v2" if i % 2 == 0 else "v1"
            seed = 1 if version == "v2" else 0
            with progress:
                target = len(results) + 20
            # Loading happens here, in this thread, while the hammer threads keep serving.
            retired.append(
                slot.load(tiny_mnn(seed), version=version, config=CPU_1, isolation=isolation)
            )

            # Wait until 20 more answers came in: with 4 threads at most 4 of them were
            # already in flight on the old version, so the new one has served.
            def reached(n=target):
                return len(results) >= n or errors

            with progress:
                served = progress.wait_for(reached, timeout=60)
            assert served and errors == []
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    assert errors == []
    assert {version for version, _ in results} == {"v1", "v2"}
    for version, outputs in results:  # every answer comes wholly from one version
        np.testing.assert_array_equal(outputs["y"], expected[version])
    current = retired.pop()
    assert slot.model is current and not current.failed
    assert all(model.failed for model in retired)  # drained, then closed
    slot.close()
    assert current.failed
    with pytest.raises(ModelFailed, match="no model version"):
        slot.run(INPUTS)


def test_in_flight_request_finishes_on_the_old_version(expected):
    old = Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1")
    entered, release = threading.Event(), threading.Event()
    real_run = old.run

    def paused_run(inputs):
        entered.set()
        release.wait()
        return real_run(inputs)

    old.run = paused_run  # type: ignore[method-assign]  # hold one request mid-flight
    slot = ModelSlot(old)
    answer = {}
    worker = threading.Thread(target=lambda: answer.update(r=slot.run_versioned(INPUTS)))
    worker.start()
    try:
        assert entered.wait(timeout=60)
        new = Model.from_bytes(tiny_mnn(1), config=CPU_1, version="v2")
        slot.swap(new)
        assert not old.failed  # still serving its in-flight request
        assert slot.run_versioned(INPUTS)[0] == "v2"  # new requests go to the new version
    finally:
        release.set()  # never leave the paused request hanging, even if an assert failed
        worker.join()
    version, outputs = answer["r"]
    assert version == "v1"
    np.testing.assert_array_equal(outputs["y"], expected["v1"])
    assert old.failed  # closed by its last request
    slot.close()


def test_a_failed_load_keeps_the_old_version_serving():
    slot = ModelSlot(Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1"))
    with pytest.raises(ModelFailed):
        slot.load(b"\x00" * 64, version="v2", config=CPU_1)
    assert slot.version == "v1" and slot.run(INPUTS)["y"].shape == (2, 4)
    slot.close()


def test_swapping_in_the_serving_model_is_a_no_op():
    model = Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1")
    slot = ModelSlot(model)
    slot.swap(slot.model)  # before: closed the model it then kept serving
    slot.swap(model, sequence=7)
    assert slot.model is model and not model.failed and slot.sequence == 7
    assert slot.run(INPUTS)["y"].shape == (2, 4)
    slot.close()
    assert model.failed


def test_an_idle_old_version_can_be_handed_back_to_close_outside_the_callers_lock():
    old = Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1")
    new = Model.from_bytes(tiny_mnn(1), config=CPU_1, version="v2")
    slot = ModelSlot(old)
    assert slot.swap(new, close_idle=False) is old and not old.failed  # not closed yet
    assert slot.version == "v2" and slot.run(INPUTS)["y"].shape == (2, 4)
    old.close()
    assert slot.swap(new, close_idle=False) is None  # the serving model: nothing retired
    held = Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v3")
    assert slot.swap(held) is None and new.failed  # by default the slot closes it
    slot.close()


def test_a_stale_sequence_is_refused_and_closed(expected):
    slot = ModelSlot()
    v2 = Model.from_bytes(tiny_mnn(1), config=CPU_1, version="v2")
    v1 = Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1")
    slot.swap(v2, sequence=2)
    with pytest.raises(StaleSwap, match="sequence 1.* stale: sequence 2 serves") as info:
        slot.swap(v1, sequence=1)
    assert (info.value.sequence, info.value.serving) == (1, 2)
    assert v1.failed and not v2.failed  # the slot owned v1: refused means closed
    np.testing.assert_array_equal(slot.run_versioned(INPUTS)[1]["y"], expected["v2"])
    slot.swap(v1 := Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1"))  # going back
    assert slot.version == "v1" and slot.sequence == 3 and v2.failed
    slot.close()


@pytest.fixture
def held_loads(monkeypatch):
    """Hold `Model.from_bytes` for the versions in the returned dict until their event is set.

    `entered[version]` is set once that load is under way (its sequence already taken).
    """
    held: dict[str, threading.Event] = {}
    entered = {version: threading.Event() for version in ("v2", "v3")}
    real = Model.from_bytes

    def from_bytes(data, **options):
        version = options.get("version")
        if version in entered:
            entered[version].set()
        gate = held.get(version)
        if gate is not None:
            assert gate.wait(timeout=60)
        return real(data, **options)

    monkeypatch.setattr(swap_module.Model, "from_bytes", from_bytes)
    return held, entered


@pytest.mark.parametrize("first_done", ["v2", "v3"])
def test_concurrent_loads_end_on_the_one_called_last(held_loads, expected, first_done):
    held_loads, entered = held_loads
    slot = ModelSlot(Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1"))
    held_loads["v2"], held_loads["v3"] = threading.Event(), threading.Event()
    outcome: dict[str, object] = {}

    def load(version, seed):
        try:
            outcome[version] = slot.load(tiny_mnn(seed), version=version, config=CPU_1)
        except StaleSwap as exc:
            outcome[version] = exc

    older = threading.Thread(target=load, args=("v2", 1))
    older.start()
    assert entered["v2"].wait(timeout=60)  # v2 took its sequence: only now is v3 asked for
    newer = threading.Thread(target=load, args=("v3", 0))
    newer.start()
    order = [older, newer] if first_done == "v2" else [newer, older]
    for thread in order:
        held_loads["v2" if thread is older else "v3"].set()
        thread.join(timeout=60)
    assert slot.version == "v3"  # whichever finished first, the later call serves
    if first_done == "v3":
        assert isinstance(outcome["v2"], StaleSwap) and not isinstance(outcome["v3"], Exception)
    else:
        assert outcome["v2"].failed  # served, then retired by v3
    assert slot.run_versioned(INPUTS)[0] == "v3"
    slot.close()


def test_a_load_that_finishes_after_close_is_stale(held_loads):
    held_loads, entered = held_loads
    slot = ModelSlot(Model.from_bytes(tiny_mnn(0), config=CPU_1, version="v1"))
    held_loads["v2"] = threading.Event()
    errors = []

    def load():
        try:
            slot.load(tiny_mnn(1), version="v2", config=CPU_1)
        except StaleSwap as exc:
            errors.append(exc)

    thread = threading.Thread(target=load)
    thread.start()
    assert entered["v2"].wait(timeout=60)
    slot.close()
    held_loads["v2"].set()
    thread.join(timeout=60)
    assert len(errors) == 1 and slot.model is None
