"""The simulator's state file: enrolled identities that a later run reuses.

It holds secrets (device credentials and private keysets), so it is written 0600 and
atomically (temp file in the same folder, fsync, rename): an interrupted run leaves the
old file or the new one, never half of either.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path

from contract import errors
from contract.key_files import read_private_file, write_private_file
from control_plane.fleet.attributes import normalize_attributes

SCHEMA = "skiff.sim-state/v1"


@dataclass(frozen=True)
class Identity:
    """One enrolled simulated device: what it needs to act again without re-enrolling."""

    device_id: str
    credential: str
    private_keyset: bytes
    attributes: dict
    signing_public_keys: tuple[bytes, ...]
    poll_interval_s: int

    def to_json(self) -> dict:
        """Return the JSON form stored in the state file."""
        return {
            "id": self.device_id,
            "credential": self.credential,
            "private_keyset": base64.b64encode(self.private_keyset).decode(),
            "attributes": self.attributes,
            "signing_public_keys": [pem.decode() for pem in self.signing_public_keys],
            "poll_interval_s": self.poll_interval_s,
        }

    @classmethod
    def from_json(cls, body: dict) -> Identity:
        """Parse one stored device (KeyError/ValueError/TypeError on a malformed entry)."""
        return cls(
            device_id=str(body["id"]),
            credential=str(body["credential"]),
            private_keyset=base64.b64decode(body["private_keyset"], validate=True),
            attributes=normalize_attributes(body["attributes"]),
            signing_public_keys=tuple(pem.encode() for pem in body["signing_public_keys"]),
            poll_interval_s=int(body["poll_interval_s"]),
        )


def load_state(path: Path) -> list[Identity]:
    """Return the identities in `path` (none if it does not exist yet)."""
    if not path.exists():
        return []
    try:
        doc = json.loads(read_private_file(path))
    except ValueError:
        raise errors.InvalidArgument(f"state file {path} is not JSON") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise errors.InvalidArgument(f"state file {path} is not a {SCHEMA} document")
    identities = []
    for i, body in enumerate(doc.get("devices", [])):
        try:
            identities.append(Identity.from_json(body))
        except (KeyError, ValueError, TypeError, AttributeError, errors.InvalidArgument):
            raise errors.InvalidArgument(f"state file {path}: devices[{i}] is malformed") from None
    return identities


def save_state(path: Path, server: str, identities: list[Identity]) -> None:
    """Write every identity to `path` (0600, atomically)."""
    doc = {
        "schema": SCHEMA,
        "server": server,
        "devices": [identity.to_json() for identity in identities],
    }
    if not path.parent.is_dir():
        raise errors.InvalidArgument(f"cannot write state file {path}: no folder {path.parent}")
    write_private_file(path, json.dumps(doc, indent=1).encode() + b"\n", replace=True)
