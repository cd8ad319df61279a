"""What a device gets from Sync and Download: signed assignments, wrapped keys, bytes.

An assignment is a document signed with the control plane's active signing key (device id, a
revision that only grows, the time it was signed and an expiry, and per model the version,
variant, version uid and digests), in the spirit of Uptane's director repository: the
device rejects a replayed, older, expired or mixed-and-matched answer. Only a device
assigned a version ever gets its data key (HPKE-wrapped to that device) or its bytes.

A device that accepts an answer sends its document back (`accepted`): only then is it
counted as synced to those versions, so an answer a device refused never counts.
"""

from __future__ import annotations

import collections
import datetime as dt
import hashlib
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from contract import errors
from contract.assignment import AssignmentRejected, load_public_keys, verify_signed
from control_plane.blobs import BlobStore
from control_plane.crypto import KeyEncryptionKey
from control_plane.crypto.device_keys import device_encrypter, wrap_context
from control_plane.crypto.signing import Signer
from control_plane.registry.registry import associated_data
from control_plane.registry.signers import SigningKeys
from control_plane.rollouts.resolver import Desired, Resolver
from control_plane.store.base import RegistryStore, VariantRecord, VersionRecord, chunk_sizes
from control_plane.store.fleet import DeviceAuth, ModelState

ASSIGNMENT_SCHEMA = "skiff.assignment/v1"
_VERSION_CACHE = 1024
_ACKED_DEVICES = 200_000  # devices whose last acknowledged revision a replica keeps
# Answers signed here lately, per device: their Ack needs no signature check (a device
# acknowledges within seconds; one that takes longer is checked as any other).
_RECENT_ANSWERS = 20_000
_SHARED_MODEL_LISTS = 4096
_KEY_CACHE = 256
_KEY_CACHE_TTL_S = 600.0
_ENCRYPTER_CACHE = 100_000
MIN_NONCE, MAX_NONCE = 16, 64
# A `cached_only` answer wraps at most this many keys (~0.1 ms each): more, off the loop.
LOOP_WRAPS = 4
# How long a signing key id that a fresh read of the chain did not hold is not looked
# for again (the chain's own refresh interval, control_plane.registry.signers.REFRESH_S).
UNKNOWN_KEY_RECHECK_S = 5.0
# The largest document a device may send back (256 models make about 150 KiB).
MAX_ACK_DOCUMENT = 1 << 20


@dataclass(frozen=True)
class Assignment:
    """One model a device should run, with everything it needs to fetch and open it."""

    model: str
    desired: Desired
    version: VersionRecord
    variant: VariantRecord
    wrapped_data_key: bytes
    url: str
    url_expires_at: dt.datetime | None


@dataclass(frozen=True)
class _Signed:
    """What an answer signed here says, to take its Ack without checking the signature."""

    document_size: int
    document_sha256: bytes
    signature: bytes
    key_id: str
    revision: int
    expires_at: dt.datetime
    models: tuple[ModelState, ...]


@dataclass(frozen=True)
class SyncResult:
    """A device's whole answer: its assignments and the signed document covering them."""

    revision: int
    assignments: tuple[Assignment, ...]
    document: bytes
    signature: bytes
    key_id: str
    # The signing-key chain of that moment (the answer carries it for verifiers).
    chain: tuple = ()


class NotCached(Exception):  # noqa: N818 - a signal, not an error
    """What a `cached_only` answer needed was not in memory (ask again, off the loop)."""


class _LruCache:
    """A small thread-safe LRU with an optional time-to-live per entry."""

    def __init__(self, size: int, ttl_s: float | None = None) -> None:
        self._size, self._ttl = size, ttl_s
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, key, make: Callable[[], object], now: float = 0.0, *, cached_only=False):
        """Return the value for `key`, made by `make` on a miss (NotCached if `cached_only`)."""
        with self._lock:
            hit = self._items.get(key)
            if hit is not None and (self._ttl is None or hit[0] > now):
                self._items.move_to_end(key)
                return hit[1]
        if cached_only:
            raise NotCached(key)
        value = make()
        with self._lock:
            self._items[key] = ((now + self._ttl) if self._ttl else 0.0, value)
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


class Delivery:
    """Builds Sync answers and guards Download; transport-free."""

    def __init__(
        self,
        *,
        store: RegistryStore,
        blobs: BlobStore,
        kek: Callable[[], KeyEncryptionKey],
        signer: SigningKeys,
        resolver: Resolver,
        assignment_ttl_s: int,
        presign_ttl_s: int,
        clock: Callable[[], dt.datetime],
        monotonic: Callable[[], float],
    ) -> None:
        self._store, self._blobs, self._kek, self._signer = store, blobs, kek, signer
        self._resolver = resolver
        self._ttl = dt.timedelta(seconds=assignment_ttl_s)
        self._presign_ttl = presign_ttl_s
        self._clock, self._monotonic = clock, monotonic
        self._versions = _LruCache(_VERSION_CACHE)
        # Unwrapping goes to the KEK (maybe a KMS round trip); a Sync storm must not.
        self._data_keys = _LruCache(_KEY_CACHE, _KEY_CACHE_TTL_S)
        self._encrypters = _LruCache(_ENCRYPTER_CACHE)
        # The part of a document's model entry shared by every device of a variant.
        self._entries = _LruCache(_VERSION_CACHE)
        # The verifying keys, parsed once per change of the valid PEMs (not per Ack).
        self._verifiers: tuple[tuple[bytes, ...], list] = ((), [])
        # The latest revision each device acknowledged here: an older answer acknowledged
        # again (a replay) must not move what it counts as synced back.
        self._acked: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._acked_lock = threading.Lock()
        # The last answer signed here for each device that Synced lately (its Ack echoes it),
        # their model lists shared: devices of one stage are told the same models.
        self._recent: collections.OrderedDict[str, _Signed] = collections.OrderedDict()
        self._models: dict[tuple[ModelState, ...], tuple[ModelState, ...]] = {}
        # Signing key ids a fresh read of the chain did not hold, until when not to look.
        self._unknown_keys: dict[str, float] = {}
        # When an Ack that no cached key verifies may next re-read the chain.
        self._ack_recheck_after = float("-inf")

    def desired(self, device_id: str, attrs: Mapping) -> tuple[int, dict[str, Desired]]:
        """Return the current revision and this device's desired models."""
        snap = self._resolver.snapshot()
        return snap.revision, snap.desired(device_id, attrs)

    def sync(
        self,
        device: DeviceAuth,
        attrs: Mapping,
        installed: tuple[ModelState, ...],
        nonce: bytes = b"",
        *,
        cached_only: bool = False,
    ) -> SyncResult:
        """Answer one device's Sync; the signed document echoes the device's nonce.

        With `cached_only` (on the event loop), NotCached when the answer needs anything
        not in memory (a version record, a data key from the KEK): ask again off the loop.
        """
        if nonce and not MIN_NONCE <= len(nonce) <= MAX_NONCE:
            raise errors.InvalidArgument(f"nonce must be {MIN_NONCE} to {MAX_NONCE} bytes")
        if cached_only:
            ready = self._signer.active_if_ready()
            if ready is None:
                raise NotCached("signing key")
            if self._blobs.presigns:
                raise NotCached("presigning may refresh the store's credentials")
            signer, chain = ready
        else:
            signer, chain = self._signer.active_and_chain()
        snap = self._resolver.current() if cached_only else self._resolver.snapshot()
        if snap is None:
            raise NotCached("rollouts changed")
        revision, desired = snap.revision, snap.desired(device.id, attrs)
        have = {(s.model, s.version, s.variant) for s in installed}
        if cached_only:
            wraps = sum((m, d.version, d.variant) not in have for m, d in desired.items())
            if wraps > LOOP_WRAPS:
                raise NotCached(f"{wraps} keys to wrap")
        assignments = tuple(
            self._assign(
                device, model, d, (model, d.version, d.variant) in have, cached_only, signer.key_id
            )
            for model, d in sorted(desired.items())
        )
        signer, chain = self._chain_for(assignments, signer, chain, cached_only)
        # To the microsecond: devices measure their clock's offset from issued_at.
        now = self._clock()
        expires = now + self._ttl
        signed = signer.sign(
            {
                "schema": ASSIGNMENT_SCHEMA,
                "device": device.id,
                "nonce": nonce.hex(),
                "revision": revision,
                "issued_at": now.isoformat(),
                "expires_at": expires.isoformat(),
                "models": {a.model: self._document_entry(a) for a in assignments},
            }
        )
        models = tuple(
            ModelState(a.model, a.desired.version, a.desired.variant) for a in assignments
        )
        models = self._interned(models)
        recent = _Signed(
            len(signed.body),
            hashlib.sha256(signed.body).digest(),
            signed.signature,
            signed.key_id,
            revision,
            # As `accepted` reads it back from the document (isoformat keeps microseconds).
            expires,
            models,
        )
        with self._acked_lock:
            self._recent[device.id] = recent
            self._recent.move_to_end(device.id)
            while len(self._recent) > _RECENT_ANSWERS:
                self._recent.popitem(last=False)
        return SyncResult(
            revision, assignments, signed.body, signed.signature, signed.key_id, chain
        )

    def _chain_for(
        self, assignments: tuple[Assignment, ...], signer: Signer, chain: tuple, cached_only: bool
    ) -> tuple[Signer, tuple]:
        """Return (`signer`, `chain`), both re-read if a manifest's signer is not in it.

        Another replica, or another worker of this server, may have rotated the signing
        key since this one last read the chain, and the rotation re-signed the manifests
        just read: the answer must carry the key that signed them. A key that a re-read
        does not find either (a database restored or edited by hand) is not looked for
        again for UNKNOWN_KEY_RECHECK_S, so it cannot cost every Sync a database read.
        """
        known = {k.key_id for k in chain}
        missing = {a.version.signing_key_id for a in assignments} - known
        now = self._monotonic()
        if not any(now >= self._unknown_keys.get(key, float("-inf")) for key in missing):
            return signer, chain
        if cached_only:
            raise NotCached("signing key")
        signer, chain = self._signer.active_and_chain(fresh=True)
        if len(self._unknown_keys) > _VERSION_CACHE:
            self._unknown_keys.clear()
        for key in missing - {k.key_id for k in chain}:
            self._unknown_keys[key] = now + UNKNOWN_KEY_RECHECK_S
        return signer, chain

    def accepted(
        self,
        device_id: str,
        document: bytes,
        signature: bytes,
        *,
        cached_only: bool = False,
        record: Callable[[tuple[ModelState, ...]], None] | None = None,
    ) -> tuple[ModelState, ...]:
        """Return the models of an answer `device_id` says it accepted (what it is synced to).

        The document must be one this control plane signed (under a key valid now), for this
        device, and not expired: InvalidArgument, PermissionDenied or FailedPrecondition.
        The last answer signed here for the device is recognised by its bytes (no signature
        check); with `cached_only` (on the event loop), NotCached for any other. `record`
        gets the models while no other Ack of the device can come between: what is
        recorded as synced follows the order the revisions were acknowledged in.
        """
        if len(document) > MAX_ACK_DOCUMENT:
            raise errors.InvalidArgument(f"document is over {MAX_ACK_DOCUMENT} bytes")
        recent = self._recent_answer(device_id, document, signature, cached_only)
        if recent is not None:
            return self._note_acked(
                device_id, recent.revision, recent.expires_at, recent.models, record
            )
        try:
            doc = self._verified(document, signature)
        except AssignmentRejected as exc:
            raise errors.InvalidArgument(
                f"not an assignment this control plane signed: {exc}"
            ) from None
        if doc.get("schema") != ASSIGNMENT_SCHEMA:
            raise errors.InvalidArgument(f"unknown assignment schema {doc.get('schema')!r:.40}")
        if doc.get("device") != device_id:
            raise errors.PermissionDenied("the assignment is for another device")
        try:
            expires = dt.datetime.fromisoformat(doc["expires_at"])
            revision = int(doc["revision"])
            models = tuple(
                ModelState(name, int(e["version"]), str(e["variant"]))
                for name, e in sorted(doc["models"].items())
            )
        except (KeyError, TypeError, ValueError, AttributeError):
            raise errors.InvalidArgument("the assignment is malformed") from None
        return self._note_acked(device_id, revision, expires, models, record)

    def _recent_answer(
        self, device_id: str, document: bytes, signature: bytes, cached_only: bool
    ) -> _Signed | None:
        """Return the answer signed here lately that these bytes are, under a key valid now."""
        with self._acked_lock:
            recent = self._recent.get(device_id)
        if (
            recent is not None
            and recent.signature == signature
            and recent.document_size == len(document)  # nothing else is hashed here
            and recent.document_sha256 == hashlib.sha256(document).digest()
        ):
            valid = self._signer.valid_key_ids(cached_only=cached_only)
            if valid is not None and recent.key_id in valid:
                return recent
        # Not that answer, its key ended since, or the chain is due for a re-read: checked
        # as any other (a signature check: off the loop).
        if cached_only:
            raise NotCached("an answer not signed here lately, or under a key not known valid")
        return None

    def _interned(self, models: tuple[ModelState, ...]) -> tuple[ModelState, ...]:
        """Return one shared copy of an answer's model list (at most 4,096 kept)."""
        with self._acked_lock:
            shared = self._models.get(models)
            if shared is None:
                if len(self._models) >= _SHARED_MODEL_LISTS:
                    self._models.clear()
                shared = self._models[models] = models
            return shared

    def _note_acked(
        self,
        device_id: str,
        revision: int,
        expires: dt.datetime,
        models: tuple[ModelState, ...],
        record: Callable[[tuple[ModelState, ...]], None] | None,
    ) -> tuple[ModelState, ...]:
        if expires <= self._clock():
            raise errors.FailedPrecondition(
                f"the assignment expired at {expires.isoformat()}: Sync again"
            )
        with self._acked_lock:
            last = self._acked.get(device_id, -1)
            if revision < last:
                raise errors.FailedPrecondition(
                    f"the assignment's revision {revision} is older than the one already "
                    f"acknowledged ({last}): Sync again"
                )
            self._acked[device_id] = revision
            self._acked.move_to_end(device_id)
            while len(self._acked) > _ACKED_DEVICES:
                self._acked.popitem(last=False)
            if record is not None:
                record(models)
        return models

    def _document_entry(self, a: Assignment) -> dict:
        """Return one model's entry of a signed document (its shared part made once)."""
        # Versions are immutable but for their manifest (re-signed at a key rotation).
        key = (a.version.uid, a.variant.name, a.version.manifest)
        shared = self._entries.get(key, lambda: _version_entry(a.version, a.variant))
        return {
            **shared,
            "version": a.desired.version,
            "variant": a.desired.variant,
            "rollout": a.desired.rollout,
            "wrapped_key_sha256": hashlib.sha256(a.wrapped_data_key).hexdigest()
            if a.wrapped_data_key
            else "",
        }

    def _verified(self, document: bytes, signature: bytes) -> dict:
        """Return the document if a key valid now signed it (AssignmentRejected if not).

        Another worker of this server, or another replica, may have signed it with a key
        rotated in since this one last read the chain: a document no cached key verifies
        is checked once more against the chain read afresh, at most once each
        UNKNOWN_KEY_RECHECK_S, so Acks with bad signatures cannot cost a database read each.
        """
        try:
            return verify_signed(document, signature, self._verifying_keys())
        except AssignmentRejected:
            now = self._monotonic()
            if now < self._ack_recheck_after:
                raise
            self._ack_recheck_after = now + UNKNOWN_KEY_RECHECK_S
            self._signer.chain(fresh=True)
            return verify_signed(document, signature, self._verifying_keys())

    def _verifying_keys(self) -> list:
        pems = tuple(self._signer.valid_public_keys())
        cached, keys = self._verifiers
        if cached != pems:
            keys = load_public_keys(pems)
            self._verifiers = (pems, keys)
        return keys

    def _assign(
        self,
        device: DeviceAuth,
        model: str,
        d: Desired,
        installed: bool,
        cached_only: bool,
        key_id: str,
    ) -> Assignment:
        version = self.version(model, d.version, cached_only=cached_only, key_id=key_id)
        variant = version.variant(d.variant)
        if variant is None:  # rollouts are checked at creation; versions are immutable
            raise errors.NotFound(f"{model}:{d.version} has no variant {d.variant!r}")
        wrapped = b""
        if not installed:
            data_key = self._data_key(version, cached_only=cached_only)
            # Parsing a device's keyset costs as much as a third of the encryption; a
            # device's key never changes, so its primitive is kept.
            encrypter = self._encrypters.get(
                device.id, lambda: device_encrypter(device.public_keyset)
            )
            wrapped = encrypter.encrypt(data_key, wrap_context(device.id, version.uid))
        url = self._blobs.presigned_url(variant.ciphertext_sha256, expires_s=self._presign_ttl)
        expires = self._clock() + dt.timedelta(seconds=self._presign_ttl) if url else None
        return Assignment(model, d, version, variant, wrapped, url or "", expires)

    def version(
        self, model: str, number: int, *, cached_only: bool = False, key_id: str = ""
    ) -> VersionRecord:
        """Return a version (cached: versions are immutable but for their manifest's signature).

        A signing-key rotation re-signs every manifest, so the cache is keyed by the active
        key (`key_id`, default: ask the chain) as well: after a rotation, devices get the
        manifest signed by the new key.
        """
        key = (model, number, key_id or self._signer.key_id)
        return self._versions.get(
            key, lambda: self._store.get_version(model, number), cached_only=cached_only
        )

    def _data_key(self, version: VersionRecord, *, cached_only: bool = False) -> bytes:
        def unwrap() -> bytes:
            return self._kek().unwrap(version.data_key, context=version.uid)

        return self._data_keys.get(version.uid, unwrap, self._monotonic(), cached_only=cached_only)

    def open_artifact(
        self, device_id: str, attrs: Mapping, artifact: str, offset: int
    ) -> tuple[int, Iterator[bytes]]:
        """Return (size, ciphertext from `offset`) of an artifact assigned to this device.

        PermissionDenied (naming nothing about the artifact) when it is not assigned.
        """
        if isinstance(offset, bool) or offset < 0:
            raise errors.InvalidArgument(f"offset must not be negative, got {offset}")
        (size,) = self.assigned_sizes(device_id, attrs, [artifact])
        if offset > size:
            raise errors.OutOfRange(
                f"offset {offset} is past the end of the artifact ({size} bytes)"
            )
        return size, self._blobs.open_read(artifact, offset=offset)

    def assigned_sizes(self, device_id: str, attrs: Mapping, artifacts: Sequence[str]) -> list[int]:
        """Return the ciphertext size of each artifact, every one assigned to this device.

        One look at the device's assignment for all of them. PermissionDenied (naming
        nothing about any artifact) when one is not assigned.
        """
        _, desired = self.desired(device_id, attrs)
        # What an assignment lets a device fetch: its variant (whole, or its chunks and
        # their key list) and the version's golden data. A chunk is served to a device
        # whose assigned variant's signed table names it, even when a version it is not
        # assigned names it too: it holds that chunk's key through its own assignment,
        # so the bytes tell it nothing new.
        tables: list[Mapping[str, int]] = []
        for model, d in desired.items():
            version = self.version(model, d.version)
            sizes = {}
            if version.golden:
                sizes[version.golden["ciphertext_sha256"]] = version.golden["ciphertext_size"]
            variant = version.variant(d.variant)
            if variant is not None:
                sizes[variant.ciphertext_sha256] = variant.ciphertext_size
                tables.append(_chunk_sizes(version.uid, variant))
            tables.append(sizes)
        found = []
        for artifact in artifacts:
            size = next((t[artifact] for t in tables if artifact in t), None) if artifact else None
            if size is None:
                raise errors.PermissionDenied("artifact is not assigned to this device")
            found.append(size)
        return found

    def read(self, artifact: str) -> Iterator[bytes]:
        """Return an artifact's ciphertext in pieces (check that it is assigned first)."""
        return self._blobs.open_read(artifact)


# {blob: ciphertext size} of recently served chunked variants, by (version uid, variant):
# versions are immutable, so the key alone names the table (no rebuild per Download).
_CHUNK_SIZES: collections.OrderedDict[tuple[str, str], dict[str, int]] = collections.OrderedDict()
_CHUNK_SIZES_KEPT = 32
_chunk_sizes_lock = threading.Lock()


def _chunk_sizes(uid: str, variant: VariantRecord) -> dict[str, int]:
    """Return {blob: ciphertext size} for a chunked variant's chunks and key list."""
    if not variant.chunks:
        return {}
    key = (uid, variant.name)
    with _chunk_sizes_lock:
        found = _CHUNK_SIZES.get(key)
        if found is not None:
            _CHUNK_SIZES.move_to_end(key)
            return found
    keys = variant.chunks["keys"]
    found = chunk_sizes(variant.chunks)
    found[keys["ciphertext_sha256"]] = keys["ciphertext_size"]
    with _chunk_sizes_lock:
        _CHUNK_SIZES[key] = found
        while len(_CHUNK_SIZES) > _CHUNK_SIZES_KEPT:
            _CHUNK_SIZES.popitem(last=False)
    return found


def _version_entry(version: VersionRecord, variant: VariantRecord) -> dict:
    """Return the part of a model's document entry every device of this variant shares."""
    return {
        "uid": version.uid,
        "ciphertext_sha256": variant.ciphertext_sha256,
        "ciphertext_size": variant.ciphertext_size,
        "segment_size": variant.segment_size,
        "plaintext_sha256": variant.plaintext_sha256,
        "plaintext_size": variant.plaintext_size,
        "associated_data": associated_data(version.uid, variant.name).decode(),
        "degraded": variant.degraded,
        "golden_sha256": version.golden.get("ciphertext_sha256", ""),
        "manifest_sha256": hashlib.sha256(version.manifest).hexdigest(),
    }
