"""The device's own key pair, read when it is first needed (`Agent` unwraps through it).

Tink (about 13 MB resident) comes with it: at start when a version is installed (serving
it unwraps its key), else with the first version to install, so an agent with nothing
installed holds none. A damaged key set then fails the start, or that install (reported,
and tried again at each sync), naming the file.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import TYPE_CHECKING

from device_agent.download import IntegrityFailure
from device_agent.state import DamagedKeySet

if TYPE_CHECKING:
    from contract.key_wrap import DeviceKeyPair


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
