"""The signing keys a CLI home pins (keys/signing_pins.json): public keys, no secrets.

`skiff init` pins the key it creates; `skiff key pin` pins a remote server's keys on
first use, explicitly. Later keys are only ever added through the endorsement chain
(`contract.pinned_keys.PinnedKeyRing.update`).
"""

from __future__ import annotations

import json
from pathlib import Path

from contract import errors
from contract.key_files import read_private_file, write_private_file
from contract.pinned_keys import PinnedKeyRing

PINS_FILE = Path("keys") / "signing_pins.json"
SCHEMA = "skiff.signing-pins/v1"


def pins_path(home: Path) -> Path:
    """Return where `home` keeps its pinned signing keys."""
    return home / PINS_FILE


def read_pins(home: Path) -> PinnedKeyRing | None:
    """Return the home's pinned keys, or None when it has none."""
    path = pins_path(home)
    try:
        doc = json.loads(read_private_file(path))
    except errors.NotFound:
        return None
    except ValueError:
        raise errors.InvalidArgument(f"{path} is not JSON") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise errors.InvalidArgument(f"{path} is not a {SCHEMA} document")
    try:
        return PinnedKeyRing.from_json(doc["keys"])
    except (KeyError, ValueError, TypeError, AttributeError) as exc:
        raise errors.InvalidArgument(f"{path}: malformed pinned keys ({exc})") from None


def write_pins(home: Path, ring: PinnedKeyRing) -> Path:
    """Store `ring` as the home's pins (0600, atomically)."""
    path = pins_path(home)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    body = {"schema": SCHEMA, "keys": ring.to_json()}
    write_private_file(
        path, (json.dumps(body, indent=2, sort_keys=True) + "\n").encode(), replace=True
    )
    return path
