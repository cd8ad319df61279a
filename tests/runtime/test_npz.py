"""runtime.npz: exact names, declared sizes checked before reading, no pickles."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from runtime.npz import read_npz, write_npz


def test_names_numpy_confuses_round_trip_exactly():
    arrays = {"a": np.zeros(2), "a.npy": np.ones(3), "file": np.arange(4), "x/y": np.array(7)}
    back = read_npz(write_npz(arrays, compress=True), "test", 1 << 20)
    assert list(back) == list(arrays)
    for name, array in arrays.items():
        np.testing.assert_array_equal(back[name], array)


def test_duplicate_members_are_refused():
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z, pytest.warns(UserWarning, match="Duplicate name"):
        z.writestr("x.npy", b"")
        z.writestr("x.npy", b"")
    with pytest.raises(ValueError, match="appears twice"):
        read_npz(buffer.getvalue(), "test", 1 << 20)


def test_the_limit_counts_declared_sizes_before_reading():
    data = write_npz({"a": np.zeros(100, np.float64), "b": np.zeros(100, np.float64)})
    assert len(read_npz(data, "test", 1600)) == 2
    with pytest.raises(ValueError, match="test is not a valid .npz: its arrays take more than"):
        read_npz(data, "test", 1599)
