"""The control plane's time as a device reads it: signed answers judged on it, skew said once."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from contract.assignment import AssignmentRejected, canonical_json, new_nonce, verify_sync
from contract.server_clock import describe_offset, skew_notice
from protos import device_pb2

DAY_AND_TWO = 26 * 3600.0


def _document(key, *, nonce: bytes, issued: dt.datetime, ttl: dt.timedelta, revision=1):
    body = canonical_json(
        {
            "schema": "skiff.assignment/v1",
            "device": "dev_1",
            "nonce": nonce.hex(),
            "revision": revision,
            "issued_at": issued.isoformat(),
            "expires_at": (issued + ttl).isoformat(),
            "models": {},
        }
    )
    return device_pb2.SyncResponse(
        revision=revision, document=body, document_signature=key.sign(body)
    )


def test_expiry_is_judged_on_the_answers_signed_time_and_replays_still_fail():
    key = Ed25519PrivateKey.generate()
    nonce = new_nonce()
    # Signed a day and more before the device's clock reads: accepted, on the server's time.
    issued = dt.datetime.now(dt.UTC) - dt.timedelta(hours=26)
    answer = _document(key, nonce=nonce, issued=issued, ttl=dt.timedelta(hours=24))
    check = dict(device_id="dev_1", keys=[key.public_key()], last_revision=0)
    verified = verify_sync(answer, nonce=nonce, round_trip_s=0.2, **check)
    assert verified.issued_at == issued
    # Judged on the device's own (wrong) clock, it would have been refused as expired.
    with pytest.raises(AssignmentRejected, match="expired"):
        verify_sync(answer, nonce=nonce, now=dt.datetime.now(dt.UTC), **check)
    # The same answer replayed to another request, or below the revision held: refused.
    with pytest.raises(AssignmentRejected, match="nonce differs"):
        verify_sync(answer, nonce=new_nonce(), round_trip_s=0.2, **check)
    with pytest.raises(AssignmentRejected, match="older"):
        verify_sync(answer, nonce=nonce, round_trip_s=0.2, **{**check, "last_revision": 2})
    # A trip longer than the answer's life: expired on the control plane's own time.
    short = _document(key, nonce=nonce, issued=issued, ttl=dt.timedelta(seconds=5))
    with pytest.raises(AssignmentRejected, match="expired .*control plane time"):
        verify_sync(short, nonce=nonce, round_trip_s=6, **check)


def test_the_skew_is_said_once_and_when_it_goes():
    said, line = skew_notice(None, 120.0)
    assert (said, line) == (None, None)
    said, line = skew_notice(None, -DAY_AND_TWO)
    assert line == describe_offset(-DAY_AND_TWO) and said == -DAY_AND_TWO
    assert skew_notice(said, -DAY_AND_TWO + 3) == (said, None)
    said, line = skew_notice(said, 2.0)
    assert said is None and line.startswith("device clock back in step")
    assert describe_offset(400) == (
        "device clock is 6.7 min ahead of the control plane; using the control plane's time"
    )
