"""`skiff key pin` and `skiff key rotate-signing`, and the pins other commands trust.

The CLI trusts a manifest only under a key its home pins. `skiff init` pins the key it
creates; a home that talks to a remote server pins that server's keys explicitly, once
(`skiff key pin`, trust on first use, with fingerprints to compare out of band). After
that, keys are added only through the endorsement chain.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import re

from contract import errors
from contract.pinned_keys import PinnedKeyRing
from control_plane.api.client import AdminClient
from control_plane.cli.connect import admin_client as _client
from control_plane.pins import pins_path, read_pins, write_pins
from control_plane.settings import Config
from protos import common_pb2

Output = tuple[object, str] | None
_DURATION = re.compile(r"(\d+)([smhd]?)")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86_400}


def add_parsers(key_sub, common) -> None:
    """Add the signing-key actions under `skiff key`."""
    p = key_sub.add_parser(
        "rotate-signing", help="make a new manifest-signing key active (old one overlaps)"
    )
    common(p)
    p.add_argument("--to", default="", help="aws-kms://KEY (ECC_NIST_P256); default: new local key")
    p.add_argument(
        "--overlap", type=parse_duration, default=0, help="e.g. 7d, 12h (default: server's)"
    )
    p = key_sub.add_parser("pin", help="trust the server's signing keys (trust on first use)")
    common(p)
    p.add_argument("--replace", action="store_true", help="discard the keys pinned so far")


def parse_duration(text: str) -> int:
    """Parse 90, 90s, 15m, 12h or 7d into seconds."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"invalid duration {text!r}: use e.g. 7d, 12h, 30m")
    return int(match[1]) * _UNIT_S[match[2]]


def fingerprint(pem: bytes) -> str:
    """Return the SHA-256 of a public key's PEM, to compare out of band."""
    return hashlib.sha256(pem).hexdigest()


def trusted_pins(config: Config, client: AdminClient) -> PinnedKeyRing:
    """Return the home's pins after walking the server's chain from them (and save them).

    FailedPrecondition, saying how to pin, when the home has none.
    """
    pins = read_pins(config.home)
    if pins is None:
        raise errors.FailedPrecondition(
            f"no pinned signing keys in {pins_path(config.home)}: run `skiff key pin` to "
            "trust the server's keys (compare the fingerprints it prints)"
        )
    updated = pins.update(client.get_signing_keys(), dt.datetime.now(dt.UTC))
    if updated != pins:
        write_pins(config.home, updated)
    return updated


def _key_dict(k: common_pb2.SigningKey) -> dict:
    return {
        "key_id": k.key_id,
        "fingerprint": fingerprint(k.public_key_pem),
        "created_at": k.created_at.ToDatetime(dt.UTC).isoformat(),
        "not_after": k.not_after.ToDatetime(dt.UTC).isoformat()
        if k.HasField("not_after")
        else None,
        "endorsed_by": k.endorsed_by,
        "active": k.active,
    }


def start_key_pin(*, config: Config, args: argparse.Namespace) -> Output:
    """Pin the keys the server says it signs with now (trust on first use, explicitly)."""
    if read_pins(config.home) is not None and not args.replace:
        raise errors.AlreadyExists(
            f"{pins_path(config.home)} already pins keys (new ones arrive through their "
            "endorsements); pass --replace to trust the server's keys anew"
        )
    with _client(config) as client:
        chain = client.get_signing_keys()
    now = dt.datetime.now(dt.UTC)
    valid = [
        k for k in chain if not k.HasField("not_after") or k.not_after.ToDatetime(dt.UTC) > now
    ]
    if not valid:
        raise errors.FailedPrecondition("the server named no valid signing key")
    ring = PinnedKeyRing.from_pems([k.public_key_pem for k in valid]).update(chain, now)
    path = write_pins(config.home, ring)
    pinned = [_key_dict(k) for k in valid if k.key_id in {p.key_id for p in ring.keys}]
    lines = [f"pinned {len(pinned)} signing key(s) in {path}:"]
    lines += [f"  {k['key_id']}  sha256:{k['fingerprint']}" for k in pinned]
    lines.append("compare these fingerprints with those your server's operator publishes")
    return {"path": str(path), "keys": pinned}, "\n".join(lines)


def start_key_rotate_signing(*, config: Config, args: argparse.Namespace) -> Output:
    """Make a new signing key active; the previous one stays valid for the overlap."""
    with _client(config) as client:
        r = client.rotate_signing_key(args.to, args.overlap)
        if read_pins(config.home) is not None:  # learn the new key now, by its endorsement
            trusted_pins(config, client)
    body = {"previous": _key_dict(r.previous), "active": _key_dict(r.active)}
    ends = body["previous"]["not_after"]
    return body, (
        f"signing key {r.active.key_id} is active (endorsed by {r.previous.key_id}, "
        f"which verifiers accept until {ends})"
    )
