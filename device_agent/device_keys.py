"""The device's own key pair, read when it is first needed (`Agent` unwraps through it).

Tink (about 13 MB resident) comes with it: at start when a version is installed (serving
it unwraps its key), else with the first version to install, so an agent with nothing
installed holds none, even just after enrolling (`new_key_pair` makes the pair in a
child). A damaged key set then fails the start, or that install (reported, and tried
again at each sync), naming the file.
"""

from __future__ import annotations

import logging
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from device_agent.download import IntegrityFailure
from device_agent.state import DamagedKeySet

if TYPE_CHECKING:
    from contract.key_wrap import DeviceKeyPair


log = logging.getLogger("skiff.agent")

_LENGTH = struct.Struct(">I")
# Run by `new_key_pair` in a child: the key pair's two key sets on stdout, each after its
# length. Only contract.key_wrap is imported (and Tink with it), never the agent.
_MAKE_PAIR = (
    "import struct, sys\n"
    "from contract.key_wrap import DeviceKeyPair\n"
    "pair = DeviceKeyPair.generate()\n"
    "for keyset in (pair.private_keyset(), pair.public_keyset()):\n"
    "    sys.stdout.buffer.write(struct.pack('>I', len(keyset)) + keyset)\n"
)
KEYGEN_TIMEOUT_S = 120.0


def new_key_pair(timeout_s: float = KEYGEN_TIMEOUT_S) -> tuple[bytes, bytes]:
    """Make the device's key pair at enrollment: (private key set, public key set).

    Made by Tink in a short-lived child process, so Tink (about 13 MB resident, and a
    process cannot give back what an import took) stays out of the agent: one that has
    just enrolled idles as small as one started with its identity, and loads Tink with
    its first install. The private half comes back over a pipe, never through a file.
    If the child cannot run (no usable interpreter, say), the pair is made here instead:
    enrolling matters more than those megabytes.
    """
    try:
        # -I: isolated, so neither the working directory nor PYTHON* variables can put
        # another module in the place of the one that makes the device's private key.
        done = subprocess.run(
            [sys.executable, "-I", "-c", _MAKE_PAIR],
            capture_output=True,
            timeout=timeout_s,
            check=True,
        )
        return _read_pair(done.stdout)
    except (OSError, subprocess.SubprocessError, ValueError) as exc:
        said = (getattr(exc, "stderr", None) or b"").decode(errors="replace").strip()
        why = said.splitlines()[-1] if said else str(exc)  # the child's last words, if any
        log.warning("making the key pair in a child failed (%s): making it here", why[:300])
    from contract.key_wrap import DeviceKeyPair

    pair = DeviceKeyPair.generate()
    return pair.private_keyset(), pair.public_keyset()


def _read_pair(out: bytes) -> tuple[bytes, bytes]:
    """Return the two key sets `_MAKE_PAIR` wrote; ValueError if that is not what came."""
    keysets, at = [], 0
    for _ in range(2):
        if len(out) < at + _LENGTH.size:
            raise ValueError("the key pair came back cut short")
        (size,) = _LENGTH.unpack_from(out, at)
        at += _LENGTH.size
        if size == 0 or len(out) < at + size:
            raise ValueError("the key pair came back cut short")
        keysets.append(out[at : at + size])
        at += size
    if at != len(out):
        raise ValueError("the key pair came back with more than two key sets")
    return keysets[0], keysets[1]


class DeviceKeys:
    """A device's key pair, parsed once from its identity's private key set."""

    def __init__(self, device_id: str, private_keyset: bytes, identity_file: Path) -> None:
        self._device_id, self._private, self._file = device_id, private_keyset, identity_file
        self._pair: DeviceKeyPair | None = None
        self._lock = threading.Lock()  # installs unwrap in threads: parse the key set once

    def load(self) -> DeviceKeyPair:
        """Return the key pair; DamagedKeySet if the key set does not parse."""
        with self._lock:
            if self._pair is None:
                from contract.key_wrap import DeviceKeyPair

                try:
                    self._pair = DeviceKeyPair.from_private(self._private)
                except Exception:  # noqa: BLE001 - Tink's own error types
                    raise DamagedKeySet(f"{self._file}: the device key set is damaged") from None
            return self._pair

    def unwrap(self, wrapped: bytes, version_uid: str) -> bytes:
        """Open a version's data key wrapped to this device; IntegrityFailure if it won't."""
        from contract.key_wrap import KeyUnwrapError

        pair = self.load()
        try:
            return pair.unwrap(wrapped, device_id=self._device_id, version_uid=version_uid)
        except KeyUnwrapError as exc:
            raise IntegrityFailure(
                f"version {version_uid}: data key does not unwrap ({exc})"
            ) from None
