"""How a pull is written: checked against the signed size and digest, then renamed."""

from __future__ import annotations

import hashlib
import itertools
import os
import stat
import threading
from types import SimpleNamespace

import pytest

from contract import errors
from control_plane.api.transfer import write_verified

MiB = 1 << 20
WAIT_S = 10  # an upper bound on a loaded machine, never a pace


def responses(data: bytes, size: int):
    return [SimpleNamespace(chunk=data[i : i + size]) for i in range(0, len(data), size)]


def expected(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


def leftovers(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".part"))


@pytest.mark.parametrize("chunk", [4096, MiB, 3 * MiB])
def test_pulled_bytes_land_whole_and_private(tmp_path, chunk):
    data = os.urandom(5 * MiB + 17)
    seen = []
    out = tmp_path / "model.mnn"
    write_verified(
        responses(data, chunk), out, expected(data), lambda done, total: seen.append(done)
    )
    assert out.read_bytes() == data
    assert stat.S_IMODE(out.stat().st_mode) == 0o600
    assert seen[-1] == len(data) and seen == sorted(seen)
    assert leftovers(tmp_path) == []


def test_a_digest_mismatch_leaves_nothing(tmp_path):
    data = os.urandom(2 * MiB)
    out = tmp_path / "model.mnn"
    with pytest.raises(errors.IntegrityError, match="signed manifest"):
        write_verified(responses(data, MiB), out, (len(data), "0" * 64), None)
    assert not out.exists() and leftovers(tmp_path) == []


def test_a_stream_longer_than_signed_stops_at_once(tmp_path):
    sent = itertools.count()

    def endless():
        for _ in sent:
            yield SimpleNamespace(chunk=b"x" * MiB)

    with pytest.raises(errors.IntegrityError, match="signed manifest"):
        write_verified(endless(), tmp_path / "model.mnn", (3 * MiB, "0" * 64), None)
    assert next(sent) == 4  # the fourth chunk was the first too many; none came after
    assert leftovers(tmp_path) == []


def test_the_next_piece_is_received_while_the_one_before_it_is_written(tmp_path, monkeypatch):
    """Hashing and writing run one piece behind the receive, not in turn with it."""
    from control_plane.api import transfer

    data = os.urandom(3 * MiB)
    asked_for_second = threading.Event()
    absorb = transfer._absorb
    overlapped = []

    def slow_absorb(digest, f, chunk):
        if not overlapped:  # the first piece: is the second asked for meanwhile?
            overlapped.append(asked_for_second.wait(WAIT_S))
        absorb(digest, f, chunk)

    def stream():
        pieces = responses(data, MiB)
        yield pieces[0]
        asked_for_second.set()
        yield from pieces[1:]

    monkeypatch.setattr(transfer, "_absorb", slow_absorb)
    out = tmp_path / "model.mnn"
    write_verified(stream(), out, expected(data), None)
    assert overlapped == [True]
    assert out.read_bytes() == data


def test_a_failed_write_stops_the_pull_and_leaves_nothing(tmp_path, monkeypatch):
    from control_plane.api import transfer

    data = os.urandom(4 * MiB)
    written = []
    absorb = transfer._absorb

    def failing_absorb(digest, f, chunk):
        if len(written) == 1:
            raise OSError(28, "No space left on device")
        written.append(len(chunk))
        absorb(digest, f, chunk)

    asked = itertools.count()

    def stream():
        for piece in responses(data, MiB):
            next(asked)
            yield piece

    monkeypatch.setattr(transfer, "_absorb", failing_absorb)
    out = tmp_path / "model.mnn"
    with pytest.raises(OSError, match="No space left"):
        write_verified(stream(), out, expected(data), None)
    assert next(asked) <= 3  # it stopped one piece behind the failure, not at the end
    assert not out.exists() and leftovers(tmp_path) == []
