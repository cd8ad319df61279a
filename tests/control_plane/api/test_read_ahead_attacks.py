"""Review attacks on the read-ahead of PullModel and Download, against a real server.

The plaintext (PullModel) and the blob (Download) are replaced by tracked generators
that record each piece's read and whether their source was closed.
"""

from __future__ import annotations

import concurrent.futures
import logging
import random
import sys
import threading
import time

import grpc
import pytest

from contract import errors
from control_plane.api import admin_service
from control_plane.api.access import caller
from control_plane.api.device_service import DeviceServicer
from protos import admin_pb2, admin_pb2_grpc, device_pb2, device_pb2_grpc
from tests.control_plane.api.device_helpers import Device
from tests.control_plane.helpers import channel_to

WAIT_S = 20
PIECE = 64 << 10
BAD = (
    "never retrieved",
    "already executing",
    "Exception ignored",
    "Traceback",
    "destroyed but it is pending",
)


class Source:
    """Generators of `n` pieces that count how many were opened, read and closed."""

    def __init__(self, n: int, piece: int = PIECE) -> None:
        self.n, self.piece = n, piece
        self.lock = threading.Lock()
        self.opened = self.closed = 0
        self.revoked = threading.Event()
        self.read_after_revoke: list[int] = []  # indexes of pieces read once revoked
        self.reads: list[tuple[str, int]] = []  # (label, index) of every piece, in read order

    def gen(self, label: str = ""):
        with self.lock:
            self.opened += 1
        try:
            for i in range(self.n):
                with self.lock:
                    if self.revoked.is_set():
                        self.read_after_revoke.append(i)
                    self.reads.append((label, i))
                yield bytes([i % 251]) * self.piece
        finally:
            with self.lock:
                self.closed += 1

    def all_closed(self, timeout: float = WAIT_S) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.closed == self.opened:
                    return True
            time.sleep(0.02)
        return False


def stuck_in_read_ahead() -> list[str]:
    """Threads whose stack is inside read_ahead.py (a read or close that never ended)."""
    found = []
    for ident, frame in sys._current_frames().items():
        f = frame
        while f is not None:
            if f.f_code.co_filename.endswith("read_ahead.py"):
                found.append(str(ident))
                break
            f = f.f_back
    return found


def _cancelled_at(start, stops: list[int]) -> None:
    """Start one call per stop, all at once; cancel each after that many messages."""

    def one(stop: int) -> None:
        call, got = start(), 0
        try:
            for _ in call:
                got += 1
                if got > stop:
                    call.cancel()
                    break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.CANCELLED, exc

    with concurrent.futures.ThreadPoolExecutor(len(stops)) as pool:
        list(pool.map(one, stops))


def _stops_cleanly(server, caplog, unraisable) -> None:
    """No thread left in a read or close; the server stops in bounded time; nothing bad logged."""
    assert stuck_in_read_ahead() == []
    t0 = time.monotonic()
    server.stop(grace=5)
    assert time.monotonic() - t0 < 15
    bad = [r.getMessage() for r in caplog.records if any(b in r.getMessage() for b in BAD)]
    assert bad == [] and unraisable == [], (bad, unraisable)


@pytest.fixture
def unraisable(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(repr(u.exc_value)))
    return seen


def _patch_pull(monkeypatch, cp, source: Source):
    real_pull = cp.app.registry.pull

    def pull(name, number, variant=""):
        record, chosen, plaintext = real_pull(name, number, variant)
        plaintext.close()
        return record, chosen, source.gen(label=caller().name)  # the token that pulls

    monkeypatch.setattr(cp.app.registry, "pull", pull)


def _pull_stub(cp):
    channel = channel_to(cp.address)
    return channel, admin_pb2_grpc.AdminServiceStub(channel)


# -- PullModel --------------------------------------------------------------------------------


def test_pulls_cancelled_at_random_points_close_everything(
    published, monkeypatch, caplog, unraisable
):
    source = Source(n=40)
    _patch_pull(monkeypatch, published, source)
    channel, stub = _pull_stub(published)
    metadata = (("authorization", f"Bearer {published.token}"),)
    stops = [random.Random(7).randrange(0, 41) for _ in range(50)]
    request = admin_pb2.PullModelRequest(name="det", version=1)
    with caplog.at_level(logging.DEBUG):
        _cancelled_at(lambda: stub.PullModel(request, metadata=metadata), stops)
        assert source.all_closed(), (source.opened, source.closed)
    channel.close()
    assert source.opened == 50
    _stops_cleanly(published.server, caplog, unraisable)


def test_a_revoked_admin_token_gets_no_piece_read_after_a_recheck(published, monkeypatch):
    """Revoked mid-pull: the first recheck that starts after the revocation (one each
    RECHECK_CHUNKS responses) refuses, and no piece is read after it but the one already
    in flight; another token's concurrent pull goes on to the end.

    Counted by events, not by time: the server's rechecks and the source's reads are
    recorded in one order, so a loaded machine that sends more or fewer pieces between
    the revocation and the recheck changes nothing asserted.
    """
    monkeypatch.setattr(admin_service, "RECHECK_CHUNKS", 8)
    source = Source(n=200, piece=256 << 10)
    _patch_pull(monkeypatch, published, source)
    rechecks: list[tuple[bool, bool]] = []  # the victim's: (started once revoked, refused)
    refused_at: list[int] = []  # len(source.reads) when the victim's recheck refused
    real_recheck = admin_service.AdminServicer._recheck

    def recheck(self) -> None:
        if caller().name != "victim":
            return real_recheck(self)
        started_revoked = source.revoked.is_set()
        try:
            real_recheck(self)
        except Exception:
            with source.lock:
                refused_at.append(len(source.reads))
            rechecks.append((started_revoked, True))
            raise
        rechecks.append((started_revoked, False))

    monkeypatch.setattr(admin_service.AdminServicer, "_recheck", recheck)
    with published.client() as client:
        made = client.create_api_token(role="admin", name="victim")
    victim = (("authorization", f"Bearer {made.secret}"),)
    owner = (("authorization", f"Bearer {published.token}"),)
    channel, stub = _pull_stub(published)
    request = admin_pb2.PullModelRequest(name="det", version=1)
    other = stub.PullModel(request, metadata=owner)
    call = stub.PullModel(request, metadata=victim)
    it = iter(call)
    next(it), next(it)  # header, one chunk
    with published.client() as client:
        client.revoke_api_token(made.token.id)  # committed when this returns
    source.revoked.set()
    with pytest.raises(grpc.RpcError) as caught:
        for _ in it:
            pass
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert sum(1 for r in other if r.chunk) == 200
    channel.close()
    assert source.all_closed(), (source.opened, source.closed)
    # One recheck refused and ended the pull, and none that started once the revocation
    # was committed let it go on: the pull stopped at the first recheck after the
    # revocation, within RECHECK_CHUNKS responses of it. (One that started between the
    # commit and `revoked.set()` may be the one that refused.)
    assert [refused for _, refused in rechecks].count(True) == 1 == len(refused_at), rechecks
    assert rechecks[-1][1], rechecks
    assert [refused for started_revoked, refused in rechecks if started_revoked] in ([], [True])
    # After that refusal, at most the piece whose read was already in its thread.
    late = [i for label, i in source.reads[refused_at[0] :] if label == "victim"]
    assert len(late) <= 1, (late, refused_at)
    victim_reads = [i for label, i in source.reads if label == "victim"]
    assert len(victim_reads) < source.n, "the victim's pull was read to the end"


# -- Download ---------------------------------------------------------------------------------


def _patch_download(monkeypatch, source: Source, size: int | None = None):
    def fake_open(self, authorization, request):
        self._device_attributes(authorization)  # the real credential check
        gen = source.gen()
        return (source.n * source.piece if size is None else size), next(gen, None), gen

    monkeypatch.setattr(DeviceServicer, "_open", fake_open)


def _download_stub(cp):
    channel = channel_to(cp.address)
    return channel, device_pb2_grpc.DeviceServiceStub(channel)


def test_downloads_cancelled_at_random_points_close_everything(
    cp, enroll_token, monkeypatch, caplog, unraisable
):
    device = Device.enroll(cp.address, enroll_token)
    source = Source(n=30)
    _patch_download(monkeypatch, source)
    channel, stub = _download_stub(cp)
    metadata = (("authorization", f"Bearer {device.credential}"),)
    stops = [random.Random(11).randrange(0, 31) for _ in range(50)]
    request = device_pb2.DownloadRequest(artifact="a" * 64)
    with caplog.at_level(logging.DEBUG):
        _cancelled_at(lambda: stub.Download(request, metadata=metadata), stops)
        assert source.all_closed(), (source.opened, source.closed)
    channel.close()
    _stops_cleanly(cp.server, caplog, unraisable)


def test_a_revoked_device_gets_no_piece_read_after_its_revocation(cp, enroll_token, monkeypatch):
    device = Device.enroll(cp.address, enroll_token)
    source = Source(n=400, piece=PIECE)  # far past any flow-control window
    _patch_download(monkeypatch, source)
    channel, stub = _download_stub(cp)
    authorization = f"Bearer {device.credential}"
    call = stub.Download(
        device_pb2.DownloadRequest(artifact="a" * 64), metadata=(("authorization", authorization),)
    )
    it = iter(call)
    received = [next(it).offset, next(it).offset]
    with cp.client() as client:
        client.revoke_device(device.id)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:  # until the change feed reached the credential cache
        try:
            cp.app.fleet.authenticate(authorization, cached_only=True)
        except errors.PermissionDenied:
            break
        time.sleep(0.01)
    source.revoked.set()
    with pytest.raises(grpc.RpcError) as caught:
        for chunk in it:
            received.append(chunk.offset)
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    first_after = min(source.read_after_revoke, default=None)
    leaked = [o for o in received if first_after is not None and o // PIECE >= first_after]
    assert leaked == [], (leaked, first_after)
    channel.close()


@pytest.mark.parametrize(
    ("pieces", "size", "want"),
    [
        (1, PIECE, [0]),  # one piece, exactly the size
        (0, 0, []),  # an empty artifact
        (3, 3 * PIECE, [0, PIECE, 2 * PIECE]),
        (2, 3 * PIECE, [0, PIECE]),  # a blob shorter than recorded: ends, as before
        (5, 2 * PIECE, [0, PIECE]),  # a blob longer than recorded: stops at the size
    ],
)
def test_download_edges(cp, enroll_token, monkeypatch, pieces, size, want):
    device = Device.enroll(cp.address, enroll_token)
    source = Source(n=pieces)
    _patch_download(monkeypatch, source, size=size)
    channel, stub = _download_stub(cp)
    call = stub.Download(
        device_pb2.DownloadRequest(artifact="a" * 64),
        metadata=(("authorization", f"Bearer {device.credential}"),),
    )
    assert [c.offset for c in call] == want
    assert source.all_closed()
    channel.close()


def test_stalled_pulls_that_the_client_cancels_are_closed(
    published, monkeypatch, caplog, unraisable
):
    """Clients that read the header, stop reading, then cancel (no server stop)."""
    source = Source(n=400, piece=256 << 10)
    _patch_pull(monkeypatch, published, source)
    channel, stub = _pull_stub(published)
    metadata = (("authorization", f"Bearer {published.token}"),)
    calls = []
    for _ in range(10):
        call = stub.PullModel(admin_pb2.PullModelRequest(name="det", version=1), metadata=metadata)
        next(call)
        calls.append(call)
    time.sleep(1)
    with caplog.at_level(logging.DEBUG):
        for call in calls:
            call.cancel()
        closed = source.all_closed(timeout=5)
    channel.close()
    bad = [r.getMessage() for r in caplog.records if any(b in r.getMessage() for b in BAD)]
    assert bad == [] and unraisable == [], (bad, unraisable)
    assert closed, (source.opened, source.closed)
