"""The fleet store interface: enrollment tokens, devices, and what each device reported."""

from __future__ import annotations

import abc
import datetime as dt
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class EnrollmentTokenRecord:
    """An enrollment token as stored (its SHA-256 only, never the token)."""

    id: str
    name: str
    attributes: dict
    expires_at: dt.datetime
    uses_left: int | None  # None = unlimited
    created_by: str
    created_at: dt.datetime


@dataclass(frozen=True)
class DeviceAuth:
    """What authenticating a device call needs: id, public key and whether it is revoked."""

    id: str
    public_keyset: bytes = field(repr=False)
    revoked: bool
    stamped_attributes: dict


@dataclass(frozen=True)
class ModelState:
    """One model on a device: a version and variant."""

    model: str
    version: int
    variant: str


@dataclass(frozen=True)
class WatchState:
    """What opening a device's Watch stream reads: attributes, revocation, what it synced."""

    attributes: dict
    revoked: bool
    synced: tuple[ModelState, ...]


@dataclass(frozen=True)
class DeviceRecord:
    """An enrolled device as stored."""

    id: str
    attributes: dict
    enrolled_at: dt.datetime
    last_seen: dt.datetime | None
    online_until: dt.datetime | None
    revoked_at: dt.datetime | None
    revoked_reason: str
    installed: tuple[ModelState, ...]
    synced: tuple[ModelState, ...]
    # Report batches refused (invalid, overlapping, over the rate) and the latest reason.
    reports_refused: int = 0
    last_refusal: str = ""
    last_refusal_at: dt.datetime | None = None
    # The device's clock minus the control plane's at its latest report.
    clock_offset_s: float | None = None


@dataclass(frozen=True)
class DeviceUpdate:
    """What one device's calls changed since the last flush (written behind, in batches).

    `installed` replaces the device's whole installed list when not None; `synced` sets
    what it fetched for the models it names and clears the others when not None.
    """

    device_id: str
    last_seen: dt.datetime
    attributes: dict | None = None
    installed: tuple[ModelState, ...] | None = None
    synced: tuple[ModelState, ...] | None = None


@dataclass(frozen=True)
class Change:
    """A committed change to the fleet's desired state, at a new revision."""

    revision: int
    kind: str  # "rollout", "device" or "resync"
    subject: str = ""


# Builds the device once its token checks out: token -> (device, credential hash, keyset).
EnrollFunc = Callable[[EnrollmentTokenRecord], tuple[DeviceRecord, str, bytes]]


class FleetStore(abc.ABC):
    """Persistent state of the fleet."""

    @abc.abstractmethod
    def add_enrollment_token(self, record: EnrollmentTokenRecord, token_sha256: str) -> None:
        """Store an enrollment token's hash and terms."""

    @abc.abstractmethod
    def enroll_device(
        self,
        *,
        token_sha256: str,
        now: dt.datetime,
        make_device: EnrollFunc,
    ) -> DeviceRecord:
        """Spend one use of the token and insert the device `make_device` builds, atomically.

        Unauthenticated when the token is unknown, expired or used up (nothing changes).
        """

    @abc.abstractmethod
    def find_device(self, credential_sha256: str) -> DeviceAuth | None:
        """Look a device up by the hash of its credential."""

    @abc.abstractmethod
    def get_device(self, device_id: str) -> DeviceRecord:
        """Return one device; NotFound otherwise."""

    @abc.abstractmethod
    def list_devices(self, *, after: str = "", limit: int | None = None) -> list[DeviceRecord]:
        """Return devices by id: those after `after`, at most `limit` (None: every one)."""

    @abc.abstractmethod
    def watch_states(self, device_ids: Sequence[str]) -> dict[str, WatchState]:
        """Return each named device's WatchState (unknown ids are left out).

        In a few statements for many devices: a reconnect storm opens thousands of streams.
        """

    @abc.abstractmethod
    def device_attributes(self, device_ids: Sequence[str]) -> dict[str, dict]:
        """Return the stored attributes of the given (non-revoked) devices."""

    @abc.abstractmethod
    def live_device_attributes(self) -> list[tuple[str, dict]]:
        """Return (id, attributes) of every device that is not revoked."""

    @abc.abstractmethod
    def revoke_device(self, device_id: str, *, at: dt.datetime, reason: str) -> DeviceRecord:
        """Mark a device revoked and bump the fleet revision; NotFound otherwise."""

    @abc.abstractmethod
    def apply_device_updates(self, updates: Sequence[DeviceUpdate]) -> None:
        """Write a batch of device updates in one transaction."""

    @abc.abstractmethod
    def set_online(self, device_ids: Sequence[str], until: dt.datetime | None) -> None:
        """Mark devices' Watch streams open until `until` (None: closed)."""

    @abc.abstractmethod
    def count_model_states(self, model: str, version: int, variant: str) -> tuple[int, int, int]:
        """Return how many live devices synced, report installed, and report failed this version."""

    @abc.abstractmethod
    def revision(self) -> int:
        """Return the current fleet revision."""
