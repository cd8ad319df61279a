"""Sparse histograms: many decoded at once read as each decoded on its own."""

from __future__ import annotations

import numpy as np
import pytest

from control_plane.store.device_table import decode_many
from control_plane.store.rollup_aggregate import decode_buckets, encode_buckets
from runtime.histogram import N_BUCKETS


def test_many_histograms_decode_as_each_does_alone():
    rng = np.random.default_rng(0)
    blobs = []
    for i in range(200):
        counts = np.zeros(N_BUCKETS, np.int64)
        filled = rng.choice(N_BUCKETS, size=int(rng.integers(0, 40)), replace=False)
        counts[filled] = rng.integers(1, 2**62, size=len(filled)) if i % 3 else 1
        blobs.append(encode_buckets(counts))  # some empty: rows with no latency
    row, index, count = decode_many(blobs)
    for i, blob in enumerate(blobs):
        own_index, own_count = decode_buckets(blob)
        assert index[row == i].tolist() == own_index.tolist()
        assert count[row == i].tolist() == own_count.astype(np.float64).tolist()
    assert (row.dtype, index.dtype, count.dtype) == (np.intp, np.intp, np.float64)
    assert [len(a) for a in decode_many([b"", b""])] == [0, 0, 0]


def test_a_histogram_of_a_wrong_length_is_refused():
    with pytest.raises(ValueError, match="wrong length"):
        decode_many([encode_buckets(np.ones(3, np.int64)), b"\x01"])
