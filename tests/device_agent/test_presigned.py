"""Downloads from an S3-compatible store's presigned URLs, with the control plane as fallback."""

from __future__ import annotations

import asyncio
import hashlib
import http.server
import threading

import boto3
import pytest

from contract.envelope import SEGMENT_SIZE
from control_plane.demo import sample_models
from device_agent import download, url_fetch
from device_agent.url_fetch import UrlFetchError, usable_url
from protos import fleet_pb2
from tests.control_plane.helpers import start_control_plane
from tests.device_agent.test_agent import once, token

MODEL = "big"


@pytest.fixture
def s3_cp(moto_endpoint, tmp_path):
    """A control plane keeping its blobs in S3 (moto on loopback), with one 3.5 MB model."""
    bucket = "skiff-" + hashlib.sha256(str(tmp_path).encode()).hexdigest()[:12]
    s3 = boto3.client("s3", endpoint_url=moto_endpoint)
    s3.create_bucket(Bucket=bucket)
    # One artifact per version (chunk_min_bytes 0): the format presigned URLs serve.
    cp = start_control_plane(
        tmp_path / "home",
        blobs=f"s3://{bucket}/blobs?endpoint_url={moto_endpoint}",
        chunk_min_bytes=0,
    )
    path = tmp_path / "big.onnx"
    path.write_bytes(sample_models.sized_mlp_onnx(int(3.5 * (1 << 20)), seed=4))
    with cp.client() as client:
        client.push(path, name=MODEL)
        client.create_rollout(fleet_pb2.CreateRolloutRequest(model=MODEL, version=1))
    _, [v] = cp.registry.show(MODEL, 1)
    cp.artifact = v.variant("fp32")
    cp.s3, cp.bucket = s3, bucket
    yield cp
    cp.stop()


def test_the_agent_downloads_from_the_presigned_url(s3_cp, tmp_path):
    outcome = asyncio.run(once(s3_cp, tmp_path / "s", enroll_token=token(s3_cp)))
    timings = outcome.installs[0].timings
    assert outcome.converged
    assert timings.url_bytes == timings.downloaded_bytes == s3_cp.artifact.ciphertext_size


def test_a_url_failing_mid_download_hands_over_to_the_control_plane(s3_cp, tmp_path, monkeypatch):
    real = url_fetch.fetch_url

    async def cut(url, offset, size):
        got = 0
        async for data in real(url, offset, size):
            yield data
            got += len(data)
            if got >= SEGMENT_SIZE + 1000:  # mid-segment: the checker holds a partial one
                raise UrlFetchError("connection reset")

    monkeypatch.setattr(download, "fetch_url", cut)
    outcome = asyncio.run(once(s3_cp, tmp_path / "s", enroll_token=token(s3_cp)))
    timings = outcome.installs[0].timings
    size = s3_cp.artifact.ciphertext_size
    assert outcome.converged and timings.downloaded_bytes == size
    assert 0 < timings.url_bytes < size


def test_a_tampered_object_behind_the_url_is_refused_segment_by_segment(s3_cp, tmp_path):
    key = next(
        o["Key"]
        for o in s3_cp.s3.list_objects_v2(Bucket=s3_cp.bucket)["Contents"]
        if o["Key"].endswith(s3_cp.artifact.ciphertext_sha256)
    )
    data = bytearray(s3_cp.s3.get_object(Bucket=s3_cp.bucket, Key=key)["Body"].read())
    data[2 * SEGMENT_SIZE + 7] ^= 0x80
    s3_cp.s3.put_object(Bucket=s3_cp.bucket, Key=key, Body=bytes(data))
    state = tmp_path / "s"
    outcome = asyncio.run(once(s3_cp, state, enroll_token=token(s3_cp)))
    (failed,) = outcome.installs
    assert failed.result == "failed" and "segment 2 does not match" in failed.reason
    part = state / "artifacts" / f"{s3_cp.artifact.ciphertext_sha256}.part"
    assert part.stat().st_size == 2 * SEGMENT_SIZE  # the verified ones, nothing more


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("https://bucket.s3.amazonaws.com/k?X-Amz-Signature=x", True),
        ("http://127.0.0.1:9000/b/k", True),
        ("http://[::1]:9000/b/k", True),
        ("http://localhost/b/k", True),
        ("http://10.0.0.5:9000/b/k", False),  # plain HTTP off loopback
        ("http://s3.example.com/b/k", False),
        ("file:///etc/passwd", False),
        ("ftp://127.0.0.1/k", False),
        ("https:///no-host", False),
        ("http://[bad/k", False),
    ],
)
def test_only_https_or_loopback_urls_are_fetched(url, ok):
    assert usable_url(url) is ok


def test_a_bad_segment_from_the_url_is_fetched_again_from_the_control_plane(
    s3_cp, tmp_path, monkeypatch
):
    real = url_fetch.fetch_url

    async def flipping(url, offset, size):
        async for data in real(url, offset, size):
            yield bytes([data[0] ^ 1]) + data[1:] if offset >= SEGMENT_SIZE else data
            offset += len(data)

    monkeypatch.setattr(download, "fetch_url", flipping)
    outcome = asyncio.run(once(s3_cp, tmp_path / "s", enroll_token=token(s3_cp)))
    timings = outcome.installs[0].timings
    size = s3_cp.artifact.ciphertext_size
    assert outcome.converged and timings.downloaded_bytes == size
    # The first segment came from the store; the control plane sent the rest.
    assert SEGMENT_SIZE <= timings.url_bytes < size


class _Store(http.server.BaseHTTPRequestHandler):
    """A blob store that misbehaves as the request path says."""

    def do_GET(self):  # noqa: N802
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "http://192.0.2.1/elsewhere")
            self.end_headers()
        elif self.path == "/wrong-range":
            self.send_response(206)
            self.send_header("Content-Range", "bytes 0-9/10")
            self.end_headers()
            self.wfile.write(b"0123456789")
        elif self.path == "/garbage":
            self.wfile.write(b"NOT HTTP AT ALL\r\n\r\n")
        else:
            self.send_response(403)
            self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def store():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Store)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize(
    ("path", "fragment"),
    [
        ("/redirect", "HTTP 302"),  # never followed: it could leave HTTPS or loopback
        ("/wrong-range", "another range than bytes 5-"),
        ("/garbage", "BadStatusLine"),
        ("/expired?X-Amz-Signature=secret", "HTTP 403"),
    ],
)
def test_a_misbehaving_store_is_a_fallback_never_a_crash(store, path, fragment):
    async def fetch():
        return [d async for d in url_fetch.fetch_url(store + path, 5, 10)]

    with pytest.raises(UrlFetchError) as caught:
        asyncio.run(fetch())
    assert fragment in str(caught.value) and "secret" not in str(caught.value)
