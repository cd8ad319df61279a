"""Golden data on the wire: PushModel's golden chunks and hints, and pulls a client refuses."""

from __future__ import annotations

import grpc
import pytest

from contract import errors
from control_plane.demo import sample_models
from protos import admin_pb2
from tests.control_plane.helpers import start_control_plane
from tests.control_plane.registry.test_registry_failures import _assert_nothing_stored, _stub


@pytest.fixture(scope="module")
def mnn_bytes() -> bytes:
    return sample_models.onnx_to_mnn_bytes(sample_models.tiny_mlp_onnx(seed=3))


@pytest.fixture
def cp(tmp_path):
    plane = start_control_plane(tmp_path / "home")
    yield plane
    plane.stop()


def _refused(cp, requests) -> grpc.RpcError:
    """Send a raw PushModel stream that must fail; return the error, check nothing stored."""
    channel, stub, metadata = _stub(cp)
    with channel, pytest.raises(grpc.RpcError) as caught:
        stub.PushModel(iter(requests), metadata=metadata)
    _assert_nothing_stored(cp)
    return caught.value


def _golden_npz() -> bytes:
    import io

    import numpy as np

    buffer = io.BytesIO()
    np.savez(buffer, x=np.ones((1, 16), np.float32))
    return buffer.getvalue()


@pytest.mark.parametrize(
    ("declared", "items", "code", "words"),
    [
        # More golden bytes than declared, fewer, none declared but some sent, and golden
        # bytes after the model's: each is refused before anything is run or stored.
        (10, [("golden_chunk", b"g" * 20)], "INVALID_ARGUMENT", "more golden bytes than"),
        (100, [("golden_chunk", b"g" * 20), ("chunk", b"m")], "INVALID_ARGUMENT", "20 golden"),
        (0, [("golden_chunk", b"g"), ("chunk", b"m")], "INVALID_ARGUMENT", "more golden bytes"),
        (-1, [("chunk", b"m")], "INVALID_ARGUMENT", "golden size -1 is negative"),
        (1 << 40, [("chunk", b"m")], "RESOURCE_EXHAUSTED", "the limit is"),
        ("model", [("golden_chunk", b"g")], "INVALID_ARGUMENT", "then golden chunks, then model"),
    ],
)
def test_golden_chunks_that_break_the_protocol_are_refused(
    cp, mnn_bytes, declared, items, code, words
):
    golden = _golden_npz()
    if declared == "model":  # a valid golden upload, then the model, then golden again
        declared = len(golden)
        items = [("golden_chunk", golden), ("chunk", mnn_bytes), *items]
    header = admin_pb2.PushHeader(name="det", golden_size=declared)
    requests = [admin_pb2.PushModelRequest(header=header)]
    requests += [admin_pb2.PushModelRequest(**{kind: data}) for kind, data in items]
    refused = _refused(cp, requests)
    assert refused.code() == getattr(grpc.StatusCode, code), refused.details()
    assert words in refused.details()


@pytest.mark.parametrize(
    ("header", "words"),
    [
        (admin_pb2.PushHeader(name="det", min_cosine=1.5), "min cosine 1.5 must be in (0, 1]"),
        (
            admin_pb2.PushHeader(
                name="det", input_shapes=[admin_pb2.InputShape(name="x", shape=[1, -4])]
            ),
            "must be positive dimensions",
        ),
        (
            admin_pb2.PushHeader(
                name="det",
                input_shapes=[admin_pb2.InputShape(name="x", shape=[1]) for _ in range(2)],
            ),
            "--input-shape names input 'x' twice",
        ),
        (
            admin_pb2.PushHeader(
                name="det", input_ranges=[admin_pb2.InputRange(name="x\n", low=0, high=1)]
            ),
            "must not contain control characters",
        ),
        (
            admin_pb2.PushHeader(
                name="det", input_ranges=[admin_pb2.InputRange(name="x", low=0, high=float("nan"))]
            ),
            "must be finite",
        ),
    ],
)
def test_bad_golden_hints_in_the_header_are_refused(cp, mnn_bytes, header, words):
    requests = [
        admin_pb2.PushModelRequest(header=header),
        admin_pb2.PushModelRequest(chunk=mnn_bytes),
    ]
    refused = _refused(cp, requests)
    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in refused.details()


def test_golden_inputs_the_model_cannot_take_store_nothing(cp, mnn_bytes, tmp_path):
    import io

    import numpy as np

    golden = tmp_path / "wrong.npz"
    buffer = io.BytesIO()
    np.savez(buffer, x=np.ones((1, 17), np.float32))  # the model takes [1, 16]
    golden.write_bytes(buffer.getvalue())
    model = tmp_path / "m.mnn"
    model.write_bytes(mnn_bytes)
    with cp.client() as client, pytest.raises(errors.InvalidArgument, match=r"\[1, 17\]"):
        client.push(model, name="det", golden=golden, variants=("int8",))
    _assert_nothing_stored(cp)


def test_a_pull_the_client_refuses_releases_the_servers_thread(tmp_path, caplog):
    """A pull whose manifest the client does not trust is cancelled, not left unread.

    Left open, the server's handler waits on flow control until the stream deadline
    (hours), keeping a thread that a server stop cannot get back.
    """
    import logging

    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from contract.pinned_keys import PinnedKeyRing

    plane = start_control_plane(tmp_path / "home")
    stranger = (
        Ed25519PrivateKey.generate()
        .public_key()
        .public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    )
    try:
        model = tmp_path / "big.onnx"
        model.write_bytes(sample_models.sized_mlp_onnx(8 << 20))  # more than a stream window
        with plane.client() as client:
            client.push(model, name="det")
            with pytest.raises(errors.SkiffError):
                client.pull("det", 1, tmp_path / "out", pins=PinnedKeyRing.from_pems([stranger]))
    finally:
        with caplog.at_level(logging.WARNING, logger="control_plane.serve"):
            plane.stop()
    assert "handler threads still busy" not in caplog.text
