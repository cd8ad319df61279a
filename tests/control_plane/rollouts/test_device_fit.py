"""Device fit: a device that cannot run a variant is not assigned it, and is counted.

A language model's variants carry what they need (memory, disk, MNN version) in the
signed manifest; devices report what they have. Over real gRPC: the small device gets
nothing (not even the key), the big one gets the bundle, and `rollout show` counts the
small one as ineligible with its reason.
"""

from __future__ import annotations

import json

import pytest

from control_plane.rollouts.fit import DISK, ENGINE, MEMORY, misfit
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.cli.test_cli import _error_line, skiff
from tests.control_plane.helpers import start_control_plane
from tests.control_plane.registry.llm.tiny_gguf import write_tiny_gguf

NEEDS = {"memory_mb": 300, "disk_mb": 150, "mnn": "3.6"}


@pytest.mark.parametrize(
    ("attrs", "reason"),
    [
        ({"ram_mb": 299}, MEMORY),
        ({"ram_mb": 300}, None),
        ({"custom": {"disk_free_mb": "149"}}, DISK),
        ({"custom": {"disk_free_mb": "150"}}, None),
        ({"custom": {"mnn": "3.5"}}, ENGINE),
        ({"custom": {"mnn": "2.9.9"}}, ENGINE),
        ({"custom": {"mnn": "3.6.1"}}, None),
        ({"custom": {"mnn": "4.0"}}, None),
        ({}, None),  # what a device does not say does not rule it out
        ({"ram_mb": 0, "custom": {"disk_free_mb": "lots", "mnn": "new"}}, None),
    ],
)
def test_misfit_names_the_first_thing_that_does_not_fit(attrs, reason):
    found = misfit(NEEDS, attrs)
    assert (found[0] if found else None) == reason, found


def test_a_variant_that_needs_nothing_fits_everywhere():
    assert misfit({}, {"ram_mb": 1}) is None


def test_a_device_that_cannot_fit_is_not_assigned_and_is_counted(tmp_path):
    cp = start_control_plane(tmp_path / "home")
    env = {"SKIFF_HOME": str(cp.config.home), "SKIFF_SERVER": cp.address, "SKIFF_TOKEN": ""}
    try:
        gguf = tmp_path / "tiny.gguf"
        write_tiny_gguf(gguf)
        skiff("model", "push", str(gguf), "--name", "tiny", "--variant", "q8", env=env)
        needs = cp.registry.variant_needs("tiny", 1, "q8")
        assert needs["memory_mb"] > 0 and needs["disk_mb"] > 0 and needs["mnn"] == "3.6"
        with cp.client() as client:
            token = client.create_enrollment_token(uses=0).token
        android = {"platform": "android"}
        small = Device.enroll(cp.address, token, {**android, "ram_mb": 1})
        big = Device.enroll(cp.address, token, {**android, "ram_mb": 8192})
        old_engine = Device.enroll(cp.address, token, {**android, "custom": {"mnn": "3.5"}})
        # Previewed before any rollout: `fleet ls --select ... --fit`.
        preview = json.loads(
            skiff(
                "fleet", "ls", "--select", "platform=android", "--fit", "tiny:1", "--json", env=env
            ).stdout
        )
        assert preview["fit"] == {
            "version": "tiny:1 (q8)",
            "fits": 1,
            "ineligible": 2,
            "ineligible_reasons": {"engine": 1, "memory": 1},
        }
        fits = {d["id"]: d["fit"] for d in preview["devices"]}
        assert fits[big.id] == {"fits": True, "reason": None, "detail": None}
        assert (
            fits[small.id]["reason"] == "memory"
            and "the device has 1" in (fits[small.id]["detail"])
        )
        assert fits[old_engine.id]["detail"].endswith("the device runs MNN 3.5")
        text = skiff("fleet", "ls", "--fit", "tiny:1", "--variant", "q8", env=env).stdout
        assert "FIT" in text and "tiny:1 (q8): 1 of 3 listed devices fit" in text
        assert "ineligible 2 (engine 1, memory 1)" in text
        for args, code, fragment in [
            (["--fit", "tiny"], 3, "give MODEL:VERSION"),
            (["--variant", "q8"], 3, "give --fit MODEL:VERSION too"),
            (["--fit", "tiny:1", "--variant", "q2"], 4, "has no variant 'q2' (it has q8)"),
            (["--fit", "nope:1"], 4, "nope"),
        ]:
            bad = skiff("fleet", "ls", *args, env=env, check=False)
            assert bad.returncode == code and fragment in _error_line(bad), (args, bad.stderr)
            assert bad.stdout == ""
        skiff("rollout", "create", "tiny:1", "--select", "platform=android", env=env)

        assert list(big.sync().models) == ["tiny"]
        assert small.sync().models == {}  # no assignment, no key
        assert old_engine.sync().models == {}

        shown = json.loads(skiff("rollout", "ls", "--json", env=env).stdout)["rollouts"][0]
        rollout = json.loads(skiff("rollout", "show", shown["id"], "--json", env=env).stdout)
        counts = rollout["counts"]
        assert counts["selected"] == 3 and counts["in_stage"] == 1
        assert counts["ineligible"] == 2
        assert counts["ineligible_reasons"] == {"engine": 1, "memory": 1}
        text = skiff("rollout", "show", shown["id"], env=env).stdout
        assert "ineligible 2 (engine 1, memory 1)" in text
    finally:
        cp.stop()


def test_a_tensor_model_states_its_disk_and_engine_and_an_older_engine_does_not_fit(tmp_path):
    from control_plane.demo import sample_models

    cp = start_control_plane(tmp_path / "home")
    env = {"SKIFF_HOME": str(cp.config.home), "SKIFF_SERVER": cp.address, "SKIFF_TOKEN": ""}
    try:
        onnx = tmp_path / "det.onnx"
        onnx.write_bytes(sample_models.tiny_mlp_onnx(seed=5))
        skiff("model", "push", str(onnx), "--name", "det", "--variant", "fp16", env=env)
        for variant in ("fp32", "fp16"):
            needs = cp.registry.variant_needs("det", 1, variant)
            assert needs["disk_mb"] >= 1 and needs["mnn"] == "3.6"
            assert "memory_mb" not in needs  # a device's probe measures that, not the push
        with cp.client() as client:
            token = client.create_enrollment_token(uses=0).token
        old = Device.enroll(cp.address, token, {"platform": "linux", "custom": {"mnn": "2.9"}})
        new = Device.enroll(cp.address, token, {"platform": "linux", "custom": {"mnn": "3.6.1"}})
        preview = json.loads(skiff("fleet", "ls", "--fit", "det:1", "--json", env=env).stdout)
        assert preview["fit"]["ineligible_reasons"] == {"engine": 1}
        skiff("rollout", "create", "det:1", "--select", "platform=linux", env=env)
        assert list(new.sync().models) == ["det"]
        assert old.sync().models == {}
    finally:
        cp.stop()
