"""The reporting budget, attacked through the real Report RPC (SQLite and PostgreSQL).

A device decides what its periods say; the server decides how much time they may cover:
periods of one device and model never overlap or start before the last accepted one
ended, and inferences are capped per second of server time since the later of the
period's start and the device's enrollment. Every refused batch is counted on the device.
"""

from __future__ import annotations

import datetime as dt

import grpc
import pytest

from contract.device_client import DeviceCallError
from contract.report_batches import new_batch_id, timestamp
from control_plane.demo import sample_models
from control_plane.telemetry.catalog import Catalog
from protos import device_pb2
from tests.control_plane.api.device_helpers import Device

MODEL = "det"


def batch(start: dt.datetime, end: dt.datetime, inferences: int, model: str = MODEL):
    stats = device_pb2.ModelStats(
        model=model, version=1, variant="fp32", config="CPU/normal/t1/mem-normal"
    )
    stats.inferences = inferences
    stats.latency.scheme = "log2/8-per-doubling/from-1us/27-doublings"
    return device_pb2.ReportRequest(
        batch_id=new_batch_id(),
        period_start=timestamp(start),
        period_end=timestamp(end),
        models=[stats],
    )


def refused(device: Device, request) -> str:
    with pytest.raises(DeviceCallError) as caught:
        device.report(request)
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    return caught.value.message


def test_periods_never_overlap_and_the_rate_is_on_server_time(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, {"soc": "sm8450"})
    now = dt.datetime.now(dt.UTC)
    enrolled = cp.app.fleet.get(device.id).enrolled_at
    # A first period backdated 29 days (within what the server keeps) claiming 3 M
    # inferences: credited only with the seconds since the device enrolled.
    backdated = batch(now - dt.timedelta(days=29), now, 3_000_000)
    message = refused(device, backdated)
    assert "more than 100000 a second" in message and enrolled.isoformat() in message
    # What the time since enrollment holds is taken.
    assert device.report(batch(enrolled, now, 10)).duplicate is False
    later = now + dt.timedelta(seconds=2)
    # The same period again (a new batch id): overlaps the accepted one.
    assert "may not overlap" in refused(device, batch(enrolled, now, 10))
    # Backdated again, twice within seconds: before the last accepted end.
    for _ in range(2):
        assert "may not overlap" in refused(device, batch(now - dt.timedelta(days=29), later, 1))
    # A period ending in the future is credited up to its arrival only.
    ahead = batch(now, now + dt.timedelta(minutes=50), 100_000 * 60 * 50)
    assert "more than 100000 a second" in refused(device, ahead)
    # Back to back is what agents send: accepted.
    assert device.report(batch(now, dt.datetime.now(dt.UTC), 1)).duplicate is False
    # One budget per device, whatever it names: another version (or model) in a batch of
    # its own over the same time overlaps too, so naming more cannot multiply the rate.
    other = batch(enrolled, now, 1)
    other.models[0].version = 2
    assert "may not overlap" in refused(device, other)
    # Nothing that was never published: each name would be rows in every rollup.
    assert "never published" in refused(device, batch(now, now, 0, model="made-up"))
    cp.app.telemetry.writer.flush()
    record = cp.app.fleet.get(device.id)
    assert record.reports_refused == 7
    assert "never published" in record.last_refusal
    assert record.last_refusal_at is not None


def test_a_refused_batch_stores_nothing_and_a_resent_one_is_applied_once(published, enroll_token):
    cp = published
    device = Device.enroll(cp.address, enroll_token, {"soc": "sm8450"})
    enrolled = cp.app.fleet.get(device.id).enrolled_at
    now = dt.datetime.now(dt.UTC)
    good = batch(enrolled, now, 5)
    assert device.report(good).duplicate is False
    # The same batch again (its reply was lost): a duplicate, not an overlap.
    assert device.report(good).duplicate is True
    bad = batch(enrolled, now, 5)
    refused(device, bad)
    cp.app.telemetry.writer.flush()
    stats = cp.app.telemetry.latency(device.id)
    assert [x.inferences for x in stats] == [5]
    assert cp.app.fleet.get(device.id).reports_refused == 1


def test_bad_enrollment_tokens_are_throttled(cp):
    """300 guesses at an enrollment token: the first few are answered UNAUTHENTICATED,
    then RESOURCE_EXHAUSTED saying when to retry, without the token being looked at."""
    codes = []
    for i in range(300):
        try:
            Device.enroll(cp.address, f"ske_guess{i:04d}", {})
        except DeviceCallError as exc:
            codes.append((exc.code, exc.message))
    assert len(codes) == 300
    unauthenticated = [c for c, _ in codes if c == grpc.StatusCode.UNAUTHENTICATED]
    exhausted = [m for c, m in codes if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert 10 <= len(unauthenticated) <= 12 and len(exhausted) == 300 - len(unauthenticated)
    assert all("too many failed attempts" in m and "try again in" in m for m in exhausted)


def test_a_used_up_token_is_no_guess(cp):
    """A factory whose single-use token ran out keeps trying it: told so each time, never
    locked out, and its next token works at once."""
    with cp.client() as client:
        once = client.create_enrollment_token(uses=1).token
    Device.enroll(cp.address, once, {})
    for _ in range(30):
        with pytest.raises(DeviceCallError) as caught:
            Device.enroll(cp.address, once, {})
        assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert "used up" in caught.value.message
    with cp.client() as client:
        fresh = client.create_enrollment_token().token
    assert Device.enroll(cp.address, fresh, {}).id


def test_a_version_published_just_after_the_catalog_was_read_is_known_at_once(published, tmp_path):
    """The published set is cached and reread at most once a second: a version pushed in
    that second, reported at once by a fast device, is still known (looked up on its
    own), and a made-up one is still refused."""
    cp = published
    now = [0.0]
    catalog = Catalog(cp.app.store, clock=lambda: now[0])
    assert catalog.published(MODEL, 1, "fp32")  # the set is read now; the clock stands
    assert not catalog.published(MODEL, 3, "fp32")
    path = tmp_path / "det.onnx"
    path.write_bytes(sample_models.tiny_mlp_onnx(seed=3))
    with cp.client() as client:
        assert client.push(path, name=MODEL).version == 3
    assert catalog.published(MODEL, 3, "fp32")
    assert not catalog.published(MODEL, 3, "int8")
    assert not catalog.published(MODEL, 4, "fp32")
    assert not catalog.published("made-up", 1, "fp32")
