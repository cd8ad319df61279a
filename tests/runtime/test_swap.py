"""Hot swap: new versions load while the old one serves; no request fails or mixes versions."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from runtime.errors import ModelFailed
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
