"""A language model's self-test is its backend probe: agreement first, then decode speed.

On a real (tiny) bundle converted by the registry: every candidate config is loaded in
its own worker, checked on the golden prompts and timed; the fastest that agrees serves.
The fleet's pick is tried first and, when it agrees here, serves without the rest; a
bundle no config agrees with is refused naming each config and why.
"""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import pytest

from contract.envelope import encrypt_chunks, new_data_key
from device_agent.llm_install import candidates, self_test
from device_agent.plaintext import from_artifact
from device_agent.state import SelfTestFailed
from tests.control_plane.helpers import start_control_plane
from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gguf

AD = b"skiff:uid:q8"
pytestmark = pytest.mark.xdist_group("llm-push")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The tiny GGUF's q8 bundle (its canonical tar) and its golden data, from a registry."""
    folder = tmp_path_factory.mktemp("probe")
    cp = start_control_plane(folder / "home")
    try:
        write_tiny_gguf(folder / "tiny.gguf")
        with cp.client() as client:
            client.push(folder / "tiny.gguf", name="tiny", variants=("q8",))
            client.pull("tiny", 1, folder / "q8.tar", pins=cp.pins, variant="q8")
        _, golden = cp.registry.golden("tiny", 1)
    finally:
        cp.stop()
    return (folder / "q8.tar").read_bytes(), golden


def _install(tmp_path, plain: bytes, recommended: str = ""):
    key = new_data_key()
    path = tmp_path / "artifact"
    path.write_bytes(b"".join(encrypt_chunks(key, iter((plain,)), associated_data=AD)))
    m = SimpleNamespace(
        associated_data=AD,
        plaintext_sha256=hashlib.sha256(plain).hexdigest(),
        plaintext_size=len(plain),
        variant="q8",
        recommended_config=recommended,
    )
    return m, from_artifact(path, key, AD, m.plaintext_sha256, m.plaintext_size)


def test_every_candidate_is_probed_and_the_fastest_that_agrees_serves(tiny, tmp_path):
    plain, golden = tiny
    m, source = _install(tmp_path, plain)
    worker, probes = self_test(m, source, golden)
    try:
        assert [p["config"] for p in probes] == [c.key for c in candidates()]
        accepted = [p for p in probes if p["accepted"]]
        assert accepted, probes
        for p in accepted:
            assert p["cosine"] >= 0.85 and p["p50_us"] > 0 and not p["recommended"]
        fastest = min(accepted, key=lambda p: p["p50_us"])
        assert worker.config.key == fastest["config"]
        assert len(json.dumps(probes)) < 4096  # what goes into the install report
    finally:
        worker.close()


def test_the_fleets_pick_serves_without_probing_the_rest(tiny, tmp_path):
    plain, golden = tiny
    pick = candidates()[-1]
    m, source = _install(tmp_path, plain, recommended=pick.key)
    worker, probes = self_test(m, source, golden)
    try:
        assert worker.config == pick
        assert [(p["config"], p["recommended"], p["accepted"]) for p in probes] == [
            (pick.key, True, True)
        ]
    finally:
        worker.close()


@pytest.mark.parametrize("pick", ["OPENCL/low/t4/mem-low", "CPU/low/t999/mem-low", "nonsense"])
def test_a_pick_this_device_cannot_run_is_not_tried(tiny, tmp_path, pick):
    plain, golden = tiny
    m, source = _install(tmp_path, plain, recommended=pick)
    assert [c.key for c in candidates(pick)] == [c.key for c in candidates()]
    worker, probes = self_test(m, source, golden)
    worker.close()
    assert pick not in [p["config"] for p in probes]


def test_a_bundle_no_config_agrees_with_is_refused_naming_each(tiny, tmp_path):
    plain, golden = tiny
    data = json.loads(golden)
    for prompt in data["prompts"]:  # answers the bundle never gives
        prompt["reference"] = [(t + 7) % 50 for t in prompt["reference"]]
    m, source = _install(tmp_path, plain)
    with pytest.raises(SelfTestFailed) as refused:
        self_test(m, source, json.dumps(data).encode())
    message = str(refused.value)
    for config in candidates():
        assert f"{config.key}: top-1 agreement with the reference" in message
