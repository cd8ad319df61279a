"""Enrollment, device credentials, and the fleet as operators see it."""

from __future__ import annotations

import datetime as dt
import hashlib
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from contract import errors
from contract.limits import MAX_NAME, MAX_REASON, check_text
from control_plane.crypto.device_keys import check_public_keyset
from control_plane.fleet.attributes import effective_attributes, normalize_attributes
from control_plane.fleet.selector import parse_selector
from control_plane.id_prefix import SHOWN, only_match
from control_plane.store.fleet import (
    Change,
    DeviceAuth,
    DeviceRecord,
    EnrollmentTokenRecord,
    FleetStore,
)

ENROLL_PREFIX = "ske_"
CREDENTIAL_PREFIX = "skd_"
DEVICE_PREFIX = "dev_"
MAX_ENROLL_TTL_S = 365 * 86_400
MAX_ENROLL_USES = 10_000_000
# How long a device's credential lookup is trusted without asking the database again.
# Revocation does not wait for it: the change feed evicts the device at once (and a
# feed that lost its connection clears the whole cache when it is back).
AUTH_CACHE_TTL_S = 3600.0
UNKNOWN_CACHE_TTL_S = 5.0
AUTH_CACHE_SIZE = 200_000
# Devices read per query while looking for a page of those a selector picks.
LIST_BATCH = 500


def _sha256(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def utcnow() -> dt.datetime:
    """Return the current time, aware UTC."""
    return dt.datetime.now(dt.UTC)


@dataclass(frozen=True)
class NewToken:
    """A freshly made enrollment token: the secret (shown once) and its stored terms."""

    token: str
    record: EnrollmentTokenRecord


class Fleet:
    """Devices: enrollment, authentication, listing and revocation."""

    def __init__(
        self, store: FleetStore, *, default_enroll_ttl_s: int, clock: Callable = utcnow
    ) -> None:
        self._store = store
        self._default_ttl = default_enroll_ttl_s
        self._clock = clock
        # credential hash -> (expiry, device or None for an unknown credential)
        self._auth_cache: dict[str, tuple[float, DeviceAuth | None]] = {}
        self._generation = 0  # bumped by every device change, under the lock
        self._lock = threading.Lock()

    # -- enrollment ----------------------------------------------------------------------

    def create_enrollment_token(
        self, *, actor: str, ttl_s: int = 0, uses: int = 0, attributes: dict, name: str = ""
    ) -> NewToken:
        """Make an enrollment token; `attributes` are stamped on every device using it.

        Stamped attributes are attested: its devices cannot change them (stamped tags
        replace reported ones), and `@` selector clauses match only them.
        """
        ttl_s = ttl_s or self._default_ttl
        if not 0 < ttl_s <= MAX_ENROLL_TTL_S:
            raise errors.InvalidArgument(f"ttl must be between 1s and {MAX_ENROLL_TTL_S}s")
        if not 0 <= uses <= MAX_ENROLL_USES:
            raise errors.InvalidArgument(f"uses must be 0 (unlimited) to {MAX_ENROLL_USES:,}")
        check_text("token name", name, MAX_NAME)
        now = self._clock()
        record = EnrollmentTokenRecord(
            id="enr_" + secrets.token_hex(6),
            name=name,
            attributes=normalize_attributes(attributes),
            expires_at=now + dt.timedelta(seconds=ttl_s),
            uses_left=uses or None,
            created_by=actor,
            created_at=now,
        )
        token = ENROLL_PREFIX + secrets.token_urlsafe(32)
        self._store.add_enrollment_token(record, _sha256(token))
        return NewToken(token, record)

    def enroll(
        self, *, token: str, attributes: dict, public_keyset: bytes
    ) -> tuple[DeviceRecord, str]:
        """Enroll a device; returns it with its credential (shown once, stored hashed)."""
        if not token.startswith(ENROLL_PREFIX) or len(token) > 128:
            raise errors.UnknownCredential("invalid enrollment token")
        reported = normalize_attributes(attributes)
        check_public_keyset(public_keyset)
        credential = CREDENTIAL_PREFIX + secrets.token_urlsafe(32)
        now = self._clock()

        def make(record: EnrollmentTokenRecord):
            device = DeviceRecord(
                id=DEVICE_PREFIX + secrets.token_hex(8),
                attributes=effective_attributes(reported, record.attributes),
                enrolled_at=now,
                last_seen=now,
                online_until=None,
                revoked_at=None,
                revoked_reason="",
                installed=(),
                synced=(),
            )
            return device, _sha256(credential), public_keyset

        device = self._store.enroll_device(token_sha256=_sha256(token), now=now, make_device=make)
        return device, credential

    # -- authentication -------------------------------------------------------------------

    def authenticate(
        self, authorization: str | None, *, cached_only: bool = False
    ) -> DeviceAuth | None:
        """Return the device a `Bearer skd_...` credential belongs to.

        Unauthenticated for a missing or unknown credential, PermissionDenied for a
        revoked device. The lookup is by hash (its timing says nothing about the secret).
        Blocking (it may ask the database): call it off the event loop; or, with
        `cached_only`, on it: then None means "not cached, ask again without".
        """
        scheme, _, credential = (authorization or "").partition(" ")
        credential = credential.strip()
        if scheme.lower() != "bearer" or not credential.startswith(CREDENTIAL_PREFIX):
            raise errors.Unauthenticated("missing device credential")
        if len(credential) > 128:
            raise errors.Unauthenticated("invalid device credential")
        digest = _sha256(credential)
        if cached_only:
            cached = self._auth_cache.get(digest)
            if cached is None or cached[0] < time.monotonic():
                return None
            device = cached[1]
        else:
            device = self._cached_lookup(digest)
        if device is None:
            raise errors.Unauthenticated("invalid device credential")
        if device.revoked:
            raise errors.PermissionDenied(f"device {device.id} is revoked")
        return device

    def _cached_lookup(self, digest: str) -> DeviceAuth | None:
        now = time.monotonic()
        cached = self._auth_cache.get(digest)
        if cached is not None and cached[0] >= now:
            return cached[1]
        generation = self._generation
        device = self._store.find_device(digest)
        # Unknown credentials are remembered briefly too, so guessing costs no queries.
        ttl = AUTH_CACHE_TTL_S if device is not None else UNKNOWN_CACHE_TTL_S
        with self._lock:
            # A change (revocation) that landed during the lookup may concern this very
            # device: caching what was read before it could undo the revocation.
            if generation == self._generation:
                self._auth_cache[digest] = (now + ttl, device)
                while len(self._auth_cache) > AUTH_CACHE_SIZE:
                    self._auth_cache.pop(next(iter(self._auth_cache)))
        return device

    def on_change(self, change: Change) -> None:
        """Drop cached credentials a change may have invalidated (change-feed subscriber)."""
        if change.kind not in ("device", "resync"):
            return
        with self._lock:
            self._generation += 1
            if change.kind == "resync":
                self._auth_cache.clear()
                return
            for digest, (_, device) in list(self._auth_cache.items()):
                if device is not None and device.id == change.subject:
                    del self._auth_cache[digest]

    def device_attributes(self, device: DeviceAuth, reported: dict) -> dict:
        """Return a Sync's effective attributes: what it reports, under what is stamped.

        The result carries the attested (stamped) ones under `"attested"`: it is what
        Sync stores and hands to every selector (see `fleet.attributes`).
        """
        return effective_attributes(reported, device.stamped_attributes)

    # -- operators ------------------------------------------------------------------------

    def list(
        self, selector: str = "", *, after: str = "", limit: int | None = None
    ) -> list[DeviceRecord]:
        """Return devices the selector picks (the evaluator rollouts use), by id.

        Only ids after `after`, at most `limit` of them (None: every one); the store is
        read in batches until the page is full or the fleet ends.
        """
        compiled = parse_selector(selector, strict=True)  # typed now: a typo is refused
        if after:
            validate_device_id(after)
        if limit is None:
            return [
                d for d in self._store.list_devices(after=after) if compiled.matches(d.attributes)
            ]
        found: list[DeviceRecord] = []
        while len(found) < limit:
            batch = self._store.list_devices(after=after, limit=LIST_BATCH)
            found += [d for d in batch if compiled.matches(d.attributes)]
            if len(batch) < LIST_BATCH:
                break
            after = batch[-1].id
        return found[:limit]

    def get(self, device_id: str) -> DeviceRecord:
        """Return one device."""
        validate_device_id(device_id)
        return self._store.get_device(device_id)

    def resolve(self, text: str) -> str:
        """Return the id of the device whose id is `text`, or the one id starting with it.

        A prefix costs one indexed read (ids in order from it): a fleet of any size.
        """
        starts_like_one = isinstance(text, str) and (
            DEVICE_PREFIX.startswith(text) or text.startswith(DEVICE_PREFIX)
        )
        if not (starts_like_one and _ID_PREFIX.fullmatch(text)):
            raise errors.InvalidArgument(f"invalid device id {text!r:.40}: expected dev_...")
        if _DEVICE_ID.fullmatch(text):
            try:
                return self._store.get_device(text).id
            except errors.NotFound:
                pass  # the start of a longer id, perhaps
        # Every id that starts with `text` sorts right after it (and each is longer).
        ids = [d.id for d in self._store.list_devices(after=text, limit=SHOWN + 1)]
        ids = [i for i in ids if i.startswith(text)]
        return only_match("device", text, ids[:SHOWN], more=len(ids) > SHOWN)

    def revoke(self, device_id: str, *, reason: str = "") -> DeviceRecord:
        """Refuse the device from now on (its open streams are closed by the change feed)."""
        validate_device_id(device_id)
        check_text("reason", reason, MAX_REASON)
        return self._store.revoke_device(device_id, at=self._clock(), reason=reason)


_DEVICE_ID = re.compile(DEVICE_PREFIX + r"[0-9a-z_-]{1,28}")
_ID_PREFIX = re.compile(r"[0-9a-z_-]{1,32}")  # what may start a device id


def validate_device_id(device_id: object) -> str:
    """Return `device_id` if it has the shape of one (dev_ and up to 28 of [0-9a-z_-]).

    Ids reach SQL from page tokens and requests: nothing else (a NUL, say) may get there.
    """
    if not (isinstance(device_id, str) and _DEVICE_ID.fullmatch(device_id)):
        raise errors.InvalidArgument(f"invalid device id {device_id!r:.40}: expected dev_...")
    return device_id
