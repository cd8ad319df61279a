"""Golden inputs at push: what a publisher gives, what the server builds, what it refuses."""

from __future__ import annotations

import io
import math
import zipfile

import numpy as np
import pytest

from contract import errors
from control_plane.registry.golden import (
    GoldenRequest,
    accuracy,
    golden_inputs,
    reference_golden,
    refuse_degraded,
)
from control_plane.registry.mnn_tools import TensorSpec
from runtime.golden import Golden
from runtime.npz import write_npz

IMAGE = TensorSpec("x", (1, 3, -1, -1), "float32")
STATE = TensorSpec("state", (2, -1, 128), "float32")
RATE = TensorSpec("sr", (), "int32")


def _npz(**arrays) -> bytes:
    return write_npz(arrays)


def test_seeded_inputs_take_hinted_shapes_and_ranges_and_are_reproducible():
    request = GoldenRequest(
        input_shapes={"x": (1, 3, 48, 64), "state": (2, 1, 128)},
        input_ranges={"sr": (16000, 16000), "state": (-0.5, 0.5)},
    )
    first = golden_inputs([IMAGE, STATE, RATE], request)
    again = golden_inputs([IMAGE, STATE, RATE], request)
    assert first["x"].shape == (1, 3, 48, 64) and first["x"].dtype == np.float32
    assert first["state"].min() >= -0.5 and first["state"].max() <= 0.5
    assert first["sr"].shape == () and first["sr"].dtype == np.int32 and first["sr"] == 16000
    for name in first:
        np.testing.assert_array_equal(first[name], again[name])


def test_dynamic_input_without_a_shape_is_refused_naming_it():
    with pytest.raises(
        errors.InvalidArgument, match=r"input 'state' has dynamic shape \[2, \?, 128\]"
    ):
        golden_inputs([STATE], GoldenRequest())


def test_every_missing_shape_and_range_is_named_at_once():
    """One refusal lists every flag to pass: Silero VAD used to take three rounds."""
    with pytest.raises(errors.InvalidArgument) as refused:
        golden_inputs([IMAGE, STATE, RATE], GoldenRequest(input_shapes={"nope": (1,)}))
    message = str(refused.value)
    assert message.startswith(
        "seeded golden inputs need --input-shape x=1,3,N,N --input-shape state=2,N,128 "
        "--input-range sr=LOW:HIGH (or golden inputs with --golden INPUTS.npz): "
    )
    for problem in (
        "--input-shape names 'nope', which is not an input",
        "input 'x' has dynamic shape [1, 3, ?, ?]",
        "input 'state' has dynamic shape [2, ?, 128]",
        "input 'sr' is int32",
    ):
        assert problem in message


def test_integer_input_needs_golden_data_or_a_range():
    with pytest.raises(errors.InvalidArgument) as refused:
        golden_inputs([RATE], GoldenRequest())
    assert "--golden" in str(refused.value) and "--input-range sr=LOW:HIGH" in str(refused.value)


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (GoldenRequest(input_shapes={"y": (1,)}), "--input-shape names 'y', which is not an input"),
        (GoldenRequest(input_ranges={"y": (0, 1)}), "--input-range names 'y'"),
        (
            GoldenRequest(input_shapes={"x": (1, 4, 8, 8)}),
            r"has shape \[1, 4, 8, 8\]; the model takes \[1, 3, \?, \?\]",
        ),
        (GoldenRequest(input_shapes={"x": (1, 3, 8)}), "the model takes"),
        (GoldenRequest(input_shapes={"x": (1, 3, 0, 8)}), "must be positive dimensions"),
        (
            GoldenRequest(input_shapes={"x": (1, 3, 1 << 20, 1 << 20)}),
            "would take 13,194,139,533,312 bytes",
        ),
        (GoldenRequest(input_ranges={"x": (1, 0)}), "low <= high"),
        (GoldenRequest(input_ranges={"x": (0, math.inf)}), "must be finite"),
        # Finite bounds whose span is not: numpy's uniform() would overflow.
        (GoldenRequest(input_ranges={"x": (-1.7e308, 1.7e308)}), "must be finite"),
        (GoldenRequest(min_cosine=0.0), r"must be in \(0, 1\]"),
        (GoldenRequest(min_cosine=1.5), r"must be in \(0, 1\]"),
        (GoldenRequest(min_cosine=math.nan), r"must be in \(0, 1\]"),
    ],
)
def test_bad_hints_are_refused_naming_the_problem(request_, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        golden_inputs([IMAGE], request_)


def test_a_range_holding_no_integer_is_refused():
    request = GoldenRequest(input_ranges={"sr": (0.2, 0.8)})
    with pytest.raises(errors.InvalidArgument, match="holds no int32 value"):
        golden_inputs([RATE], request)


def test_publisher_inputs_are_checked_and_cast_to_the_model_dtypes():
    given = {"x": np.ones((1, 3, 8, 8), np.float64), "sr": np.array(16000, np.int64)}
    found = golden_inputs([IMAGE, RATE], GoldenRequest(golden=_npz(**given)))
    assert found["x"].dtype == np.float32 and found["x"].shape == (1, 3, 8, 8)
    assert found["sr"].dtype == np.int32 and found["sr"] == 16000


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"x": np.ones((1, 3, 8, 8), np.float32)}, "--golden has no array for input 'sr'"),
        (
            {"x": np.ones((1, 3, 8, 8), np.float32), "sr": np.array(1), "extra": np.ones(1)},
            "--golden has 'extra', which is not an input",
        ),
        ({"x": np.ones((1, 4, 8, 8), np.float32), "sr": np.array(1)}, r"has shape \[1, 4, 8, 8\]"),
        ({"x": np.ones((1, 3, 8, 8), np.float32), "sr": np.array(1.5)}, "these values do not fit"),
        ({"x": np.ones((1, 3, 8, 8), np.float32), "sr": np.array(1 << 40)}, "do not fit"),
        ({"x": np.array(["a"]), "sr": np.array(1)}, "not numeric"),
    ],
)
def test_bad_publisher_inputs_are_refused_naming_the_input(arrays, message):
    with pytest.raises(errors.InvalidArgument, match=message):
        golden_inputs([IMAGE, RATE], GoldenRequest(golden=_npz(**arrays)))


def test_golden_files_that_are_not_plain_npz_are_refused():
    pickled = io.BytesIO()
    np.save(pickled, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("x.npy", pickled.getvalue())
    bomb = io.BytesIO()
    with zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("x.npy", b"\0" * (300 << 20))  # 300 MiB of zeros, ~300 KiB compressed
    for data, message in (
        (b"not a zip", "--golden is not a valid .npz"),
        (archive.getvalue(), "--golden is not a valid .npz"),  # object arrays need pickle
        (bomb.getvalue(), "--golden is not a valid .npz"),  # checked by header, not inflated
    ):
        with pytest.raises(errors.InvalidArgument, match=message):
            golden_inputs([IMAGE], GoldenRequest(golden=data))


def test_accuracy_refuses_a_variant_below_the_bar_unless_allowed():
    reference = {"a": np.array([1.0, 2.0, 3.0]), "b": np.array([1.0, -1.0])}
    good = {"a": np.array([1.0, 2.0, 3.01]), "b": np.array([1.0, -1.0])}
    bad = {"a": np.array([1.0, 2.0, 3.0]), "b": np.array([1.0, 0.0])}  # b: cosine 0.7071
    passed = accuracy("fp16", reference, good, GoldenRequest())
    assert not passed.degraded and passed.figures["cosine"] > 0.9999
    assert [o["name"] for o in passed.figures["outputs"]] == ["a", "b"]
    judged = accuracy("int8", reference, bad, GoldenRequest())
    assert judged.degraded and judged.figures["min_cosine"] == 0.99
    with pytest.raises(
        errors.InvalidModel, match="int8 degraded: cosine 0.7071 below 0.99 on output 'b'"
    ):
        refuse_degraded({"fp16": passed, "int8": judged}, GoldenRequest())
    refuse_degraded({"fp16": passed, "int8": judged}, GoldenRequest(allow_degraded=True))
    lenient = accuracy("int8", reference, bad, GoldenRequest(min_cosine=0.7))
    assert not lenient.degraded


def test_non_finite_variant_outputs_are_degraded_and_json_safe():
    reference = {"a": np.array([1.0, 2.0])}
    nan = {"a": np.array([np.nan, 2.0])}
    kept = accuracy("fp16", reference, nan, GoldenRequest(allow_degraded=True))
    assert kept.degraded
    assert kept.figures["max_abs_error"] is None  # JSON has no infinity
    assert kept.figures["outputs"][0] == {
        "name": "a",
        "cosine": 0.0,
        "max_abs_error": None,
        "relative_error": None,
    }


def test_reference_outputs_must_be_finite():
    with pytest.raises(errors.InvalidModel, match="fp32 output 'y' is not finite"):
        reference_golden({"x": np.ones(2, np.float32)}, {"y": np.array([np.inf], np.float32)})
    stored = Golden.from_npz(
        reference_golden({"x": np.ones(2, np.float32)}, {"y": np.ones(1, np.float32)})
    )
    assert list(stored.inputs) == ["x"] and list(stored.outputs) == ["y"]


def test_many_seeded_inputs_are_capped_in_total():
    """Six static [1, 64Mi] inputs: each fits a per-input cap, together 1.5 GiB."""
    inputs = [TensorSpec(f"x{i}", (1, 64 << 20), "float32") for i in range(6)]
    with pytest.raises(errors.InvalidArgument, match="seeded golden inputs would take"):
        golden_inputs(inputs, GoldenRequest())


def test_publisher_inputs_are_capped_after_casting():
    """32 KiB of compressed bools (32 MiB) that would become 128 MiB of float32."""
    spec = TensorSpec("x", (1, -1), "float32")
    bools = np.zeros((1, 1 << 25), np.bool_)
    data = write_npz({"x": bools}, compress=True)
    assert len(data) < 1 << 20
    with pytest.raises(errors.InvalidArgument, match="--golden golden inputs would take"):
        golden_inputs([spec], GoldenRequest(golden=data))


@pytest.mark.parametrize("name", ["file", "allow_pickle", "a/b", "a.npy"])
def test_any_input_name_round_trips(name):
    spec = TensorSpec(name, (2,), "float32")
    given = np.array([1.0, 2.0], np.float32)
    found = golden_inputs([spec], GoldenRequest(golden=write_npz({name: given})))
    np.testing.assert_array_equal(found[name], given)


def test_npz_members_that_are_not_arrays_or_lie_about_their_size_are_refused():
    raw = io.BytesIO()
    with zipfile.ZipFile(raw, "w") as z:
        z.writestr("x", b"raw bytes, not an .npy")
    huge = io.BytesIO()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        header, {"descr": "<f4", "fortran_order": False, "shape": (1 << 35,)}
    )
    with zipfile.ZipFile(huge, "w") as z:
        z.writestr("x.npy", b"\x93NUMPY\x01\x00" + header.getvalue()[8:])
    for data, message in (
        (raw.getvalue(), "member 'x' is not an .npy array"),
        (huge.getvalue(), "its arrays take more than"),
    ):
        with pytest.raises(errors.InvalidArgument, match=message):
            golden_inputs([TensorSpec("x", (1,), "float32")], GoldenRequest(golden=data))


def test_a_variant_with_the_right_direction_and_the_wrong_scale_is_degraded():
    reference = {"y": np.array([3.0, 4.0])}
    shrunk = {"y": np.array([0.2, 0.26666])}  # 15x too small: cosine 1.0
    kept = accuracy("fp16", reference, shrunk, GoldenRequest())
    assert kept.degraded and kept.figures["cosine"] > 0.9999
    with pytest.raises(
        errors.InvalidModel,
        match=r"fp16 degraded: relative error 0.933 above 0.141 \(cosine 1.0000 >= 0.99\)",
    ):
        refuse_degraded({"fp16": kept}, GoldenRequest())
    assert kept.figures["relative_error"] == pytest.approx(0.9333, abs=1e-3)


def test_each_variant_is_held_to_what_was_measured_for_it():
    reference = {"y": np.array([1.0, 0.0, 1.0])}
    int8 = {"y": np.array([1.0, 0.2, 0.9])}
    bar = accuracy("int8", reference, int8, GoldenRequest(min_cosine=0.9))
    measured = bar.figures["cosine"]
    assert 0.9 < measured < 0.99 and bar.self_test.min_cosine == pytest.approx(measured - 0.005)
    stored = Golden.from_npz(
        reference_golden(
            {"x": np.ones(2, np.float32)}, {"y": np.ones(3, np.float32)}, {"int8": bar.self_test}
        )
    )
    assert stored.tolerance.min_cosine == 0.999  # fp32 itself
    assert stored.for_variant("int8").tolerance == bar.self_test
    assert stored.for_variant("fp16").tolerance == stored.tolerance
