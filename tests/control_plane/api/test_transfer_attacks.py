"""Review attacks on write_verified's one-piece-behind writer thread."""

from __future__ import annotations

import hashlib
import os
import threading
from types import SimpleNamespace

import pytest

from contract import errors
from control_plane.api import transfer
from control_plane.api.transfer import write_verified

MiB = 1 << 20
WAIT_S = 10


def responses(data: bytes, size: int):
    return [SimpleNamespace(chunk=data[i : i + size]) for i in range(0, len(data), size)]


def expected(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def writer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("skiff-pull-write")]


def test_an_interrupt_from_the_stream_midway_leaves_nothing_and_no_thread(tmp_path):
    data = os.urandom(4 * MiB)

    def stream():
        pieces = responses(data, MiB)
        yield from pieces[:2]
        raise KeyboardInterrupt

    out = tmp_path / "model.mnn"
    with pytest.raises(KeyboardInterrupt):
        write_verified(stream(), out, expected(data), None)
    assert names(tmp_path) == []
    assert writer_threads() == []


def test_an_interrupt_while_the_previous_piece_is_still_being_written(tmp_path, monkeypatch):
    """The stream fails while the writer thread is inside a slow write of the piece before."""
    data = os.urandom(3 * MiB)
    inside, release = threading.Event(), threading.Event()
    absorb = transfer._absorb

    def slow_absorb(digest, f, chunk):
        inside.set()
        release.wait(WAIT_S)
        absorb(digest, f, chunk)

    def stream():
        pieces = responses(data, MiB)
        yield pieces[0]
        assert inside.wait(WAIT_S)
        threading.Timer(0.2, release.set).start()
        raise RuntimeError("connection reset")

    monkeypatch.setattr(transfer, "_absorb", slow_absorb)
    out = tmp_path / "model.mnn"
    with pytest.raises(RuntimeError, match="connection reset"):
        write_verified(stream(), out, expected(data), None)
    assert release.is_set()  # the call waited for the write in flight before returning
    assert names(tmp_path) == []
    assert writer_threads() == []


def test_a_failed_write_of_the_last_piece_leaves_nothing(tmp_path, monkeypatch):
    data = os.urandom(3 * MiB)
    absorb = transfer._absorb
    calls = []

    def failing_absorb(digest, f, chunk):
        calls.append(len(chunk))
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        absorb(digest, f, chunk)

    monkeypatch.setattr(transfer, "_absorb", failing_absorb)
    out = tmp_path / "model.mnn"
    with pytest.raises(OSError, match="No space"):
        write_verified(responses(data, MiB), out, expected(data), None)
    assert names(tmp_path) == []


def test_a_digest_mismatch_of_the_right_size_creates_nothing(tmp_path):
    data = os.urandom(3 * MiB)
    tampered = data[:-1] + bytes([data[-1] ^ 1])
    out = tmp_path / "model.mnn"
    with pytest.raises(errors.IntegrityError):
        write_verified(responses(tampered, MiB), out, expected(data), None)
    assert names(tmp_path) == []


def test_a_digest_mismatch_keeps_an_existing_out_untouched(tmp_path):
    data = os.urandom(2 * MiB)
    out = tmp_path / "model.mnn"
    out.write_bytes(b"old model")
    with pytest.raises(errors.IntegrityError):
        write_verified(responses(os.urandom(2 * MiB), MiB), out, expected(data), None)
    assert out.read_bytes() == b"old model"
    assert names(tmp_path) == ["model.mnn"]


def test_a_stream_shorter_than_signed_creates_nothing(tmp_path):
    data = os.urandom(3 * MiB)
    out = tmp_path / "model.mnn"
    with pytest.raises(errors.IntegrityError):
        write_verified(responses(data[: 2 * MiB], MiB), out, expected(data), None)
    assert names(tmp_path) == []


def test_progress_is_called_in_order_and_reaches_the_total(tmp_path):
    data = os.urandom(5 * MiB + 3)
    seen = []
    write_verified(
        responses(data, 700_000), tmp_path / "m", expected(data), lambda d, t: seen.append((d, t))
    )
    assert [d for d, _ in seen] == sorted({d for d, _ in seen})
    assert seen[-1] == (len(data), len(data))
    assert (tmp_path / "m").read_bytes() == data


def test_a_progress_callback_that_raises_leaves_nothing(tmp_path):
    data = os.urandom(3 * MiB)

    def progress(done, total):
        if done > MiB:
            raise BrokenPipeError("progress bar's terminal went away")

    with pytest.raises(BrokenPipeError):
        write_verified(responses(data, MiB), tmp_path / "m", expected(data), progress)
    assert names(tmp_path) == []
    assert writer_threads() == []


def test_out_never_holds_partial_content_during_the_pull(tmp_path):
    data = os.urandom(4 * MiB)
    out = tmp_path / "model.mnn"
    seen_out = []

    def stream():
        for piece in responses(data, MiB):
            seen_out.append(out.exists())
            yield piece

    write_verified(stream(), out, expected(data), None)
    assert seen_out == [False] * 4
    assert out.read_bytes() == data


def test_many_pulls_leave_no_writer_thread_behind(tmp_path):
    data = os.urandom(MiB + 1)
    for i in range(50):
        write_verified(responses(data, 65536), tmp_path / f"m{i}", expected(data), None)
    assert writer_threads() == []
