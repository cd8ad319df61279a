"""Ctrl-C during `skiff model push`: a short message, one server log line, nothing stored.

Before, the client exited 130 without a word, and a push cancelled while the server
checked it left "Future exception was never retrieved" and a traceback in the server log.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import subprocess
import threading
import time

import pytest

from control_plane.api import admin_service
from control_plane.api.client import AdminClient
from control_plane.api.transfer import push_requests, size_and_digest
from control_plane.demo import sample_models
from control_plane.home import init_home, read_token
from control_plane.settings import load_config
from protos import admin_pb2, admin_pb2_grpc
from tests.control_plane.cli.test_cli import SKIFF_AT_A_TERMINAL
from tests.control_plane.helpers import (
    spawn_server,
    spooling,
    start_control_plane,
    stop_server,
    tls_of,
)

BIG = 512 << 20  # a sparse file: seconds to upload, nothing to write to disk


def _uploading(server_pid: int, timeout: float = 120) -> None:
    """Wait until the server spools an upload (its memfd is open), the mid-upload moment."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if spooling(server_pid):
            return
        time.sleep(0.01)
    raise AssertionError("the server never started receiving the upload")


def test_ctrl_c_mid_upload_says_so_and_stores_nothing(tmp_path):
    home = tmp_path / "home"
    init_home(load_config(home, environ={}))
    log = tmp_path / "server.log"
    with log.open("w") as stderr:
        server, address = spawn_server(home, stderr=stderr)
    big = tmp_path / "big.mnn"
    with big.open("wb") as f:
        f.truncate(BIG)
    env = {**os.environ, "SKIFF_HOME": str(home), "SKIFF_SERVER": address, "SKIFF_TOKEN": ""}
    try:
        push = subprocess.Popen(
            [*SKIFF_AT_A_TERMINAL, "model", "push", str(big), "--name", "big"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            _uploading(server.pid)
            # Held mid-upload: a loaded machine could otherwise let the rest of the file
            # through (and the server refuse it) before the Ctrl-C lands.
            os.kill(server.pid, signal.SIGSTOP)
        finally:
            push.send_signal(signal.SIGINT)
            try:
                out, err = push.communicate(timeout=60)
            finally:
                os.kill(server.pid, signal.SIGCONT)
        assert push.returncode == 130, err
        assert err == "skiff: push cancelled: nothing stored (the upload was cut short)\n"
        assert out == ""
        with AdminClient(address, read_token(home), tls_of(address)) as client:
            assert client.list_models() == []  # no version
    finally:
        status = stop_server(server, log)
    text = log.read_text()
    assert status == 0, text
    assert "Traceback" not in text and "never retrieved" not in text, text
    after_start = text.split("listening on port", 1)[1].splitlines()[1:]
    assert len(after_start) == 1, text
    # Mid-upload, or (on a fast machine) as the last bytes arrived: either way one line.
    assert "push of 'big' cancelled " in after_start[0]
    assert after_start[0].endswith("nothing stored")
    assert list((home / "blobs").iterdir()) == []


@pytest.fixture
def onnx_path(tmp_path):
    path = tmp_path / "det.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=1))
    return path


@pytest.fixture
def plane(tmp_path):
    cp = start_control_plane(tmp_path / "home")
    yield cp
    cp.stop()


def test_a_push_cancelled_while_the_server_checks_it_logs_one_line(
    plane, onnx_path, caplog, monkeypatch
):
    # The push's thread is held until the server has seen the call go, so the cancel
    # lands while the server checks the upload: the case that left an unretrieved
    # exception (and its traceback) in the log.
    checking, release = threading.Event(), threading.Event()
    seen: dict = {}
    push_spooled = plane.registry.push_spooled

    def held(request, upload, *, abandoned):
        seen["abandoned"] = abandoned
        checking.set()
        assert release.wait(60)
        return push_spooled(request, upload, abandoned=abandoned)

    monkeypatch.setattr(plane.registry, "push_spooled", held)
    ended = _Seen()
    logging.getLogger(admin_service.__name__).addHandler(ended)
    caplog.set_level(logging.INFO)
    size, digest = size_and_digest(onnx_path)
    header = admin_pb2.PushHeader(name="det", filename=onnx_path.name, size=size, sha256=digest)
    try:
        with plane.channel() as channel:
            call = admin_pb2_grpc.AdminServiceStub(channel).PushModel.future(
                push_requests(onnx_path, header, None),
                metadata=(("authorization", f"Bearer {plane.token}"),),
            )
            assert checking.wait(60)
            call.cancel()
        deadline = time.monotonic() + 60
        while not seen["abandoned"]():  # the server's done-callback has run
            assert time.monotonic() < deadline, "the server never saw the push cancelled"
            time.sleep(0.01)
        release.set()
        assert ended.event.wait(60)
    finally:
        release.set()
        logging.getLogger(admin_service.__name__).removeHandler(ended)
    gc.collect()  # an unretrieved exception is reported when its future is collected
    lines = [r.getMessage() for r in caplog.records if "det" in r.getMessage()]
    assert lines == ["push of 'det' cancelled while the server checked it: nothing stored"]
    assert not [r for r in caplog.records if r.exc_info or "never retrieved" in r.getMessage()]
    with plane.client() as client:
        assert client.list_models() == []


class _Seen(logging.Handler):
    """Sets `event` at the first record logged."""

    def __init__(self) -> None:
        super().__init__()
        self.event = threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.event.set()
