"""Watch streams: tell a device to Sync only when its own desired state changed.

Each replica keeps its open streams in memory, on the server's event loop. When the
change feed reports a new revision, the replica recomputes every watcher's desired state
from the new snapshot (all in memory) and sends the revision only to the devices whose
state differs from what they were last told. Revocation closes the device's stream at
once. While a stream is open the replica marks the device online in the database, so
every replica's `fleet ls` can say which devices are online.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field

from contract import errors
from control_plane.rollouts.resolver import Desired, Resolver, Snapshot
from control_plane.store.fleet import Change, FleetStore

log = logging.getLogger(__name__)

Fingerprint = frozenset[tuple[str, int, str]]
NOTIFY_SLICE = 500  # watchers checked between two turns of the event loop
_REVOKED, _REPLACED = -1, -2


def fingerprint(desired: Mapping[str, Desired]) -> Fingerprint:
    """Return what matters to a device about its desired state (not which rollout)."""
    return frozenset((m, d.version, d.variant) for m, d in desired.items())


@dataclass(eq=False)
class _Watcher:
    device_id: str
    attrs: Mapping
    fingerprint: Fingerprint
    queue: asyncio.Queue = field(default_factory=lambda: asyncio.Queue(maxsize=1))
    closed: bool = False  # revoked or replaced: what is queued stays the last item

    def push(self, item: int) -> None:
        # Only the newest revision matters; a device that has not read the last one yet
        # gets this one instead. A close (revoked, replaced) is final: nothing replaces it,
        # or a revision pushed after it (the stream's own "you missed a change" while it
        # loads) would leave a stream no one holds open for good.
        if self.closed:
            return
        self.closed = item in (_REVOKED, _REPLACED)
        if self.queue.full():
            self.queue.get_nowait()
        self.queue.put_nowait(item)


class Watchers:
    """The open Watch streams of this replica."""

    def __init__(
        self,
        *,
        resolver: Resolver,
        store: FleetStore,
        online_ttl_s: float = 30.0,
        heartbeat_s: float = 10.0,
        flush_s: float = 1.0,
    ) -> None:
        self._resolver, self._store = resolver, store
        self._online_ttl, self._heartbeat, self._flush = online_ttl_s, heartbeat_s, flush_s
        self._by_device: dict[str, _Watcher] = {}
        # Streams opened or closed since the last write, recorded within `flush_s`; every
        # open stream's mark is refreshed every `heartbeat_s`.
        self._opened: set[str] = set()
        self._closed: set[str] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: list[Change] = []
        self._tasks: list[asyncio.Task] = []
        self._notified = 0  # the newest revision watchers were checked against

    def __len__(self) -> int:
        return len(self._by_device)

    def is_online(self, device_id: str) -> bool:
        """Return whether the device has a Watch stream open on this replica."""
        return device_id in self._by_device

    async def start(self) -> None:
        """Bind to the running loop and start the online heartbeat."""
        self._loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._heartbeat_loop()))

    async def stop(self) -> None:
        """Stop the heartbeat and mark this replica's devices offline."""
        for task in self._tasks:
            task.cancel()
        ids = list(self._by_device) + list(self._closed)
        if ids:
            try:
                await asyncio.to_thread(self._store.set_online, ids, None)
            except errors.Unavailable as exc:
                # Stopping goes on: their streams' online marks expire on their own.
                log.warning("could not mark %d devices offline on stop: %s", len(ids), exc)

    # -- change feed (any thread) -------------------------------------------------------

    def on_change(self, change: Change) -> None:
        """Queue a recheck on the loop (change-feed subscriber; called from any thread)."""
        if self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._enqueue, change)

    def _enqueue(self, change: Change) -> None:
        self._pending.append(change)
        if len(self._pending) == 1:  # one recheck covers every change queued before it
            self._loop.call_soon(self._recheck)

    def _recheck(self) -> None:
        changes, self._pending = self._pending, []
        for c in changes:
            if c.kind == "device" and c.subject in self._by_device:
                self._by_device.pop(c.subject).push(_REVOKED)
        if any(c.kind == "resync" for c in changes):
            self._tasks.append(asyncio.ensure_future(self._resync()))
        else:
            self._tasks.append(asyncio.ensure_future(self._notify_latest()))
        self._tasks = [t for t in self._tasks if not t.done()]

    async def _notify_latest(self) -> None:
        # Loading the snapshot may read the database: off the loop.
        snap = await asyncio.to_thread(self._resolver.snapshot)
        await self.notify_changed(snap)

    async def notify_changed(self, snap: Snapshot) -> int:
        """Send `snap.revision` to every watcher whose desired state changed; return count.

        Watchers are checked NOTIFY_SLICE at a time, the loop running in between: with
        10k streams a check of all at once held the loop (and so every push, every
        stream and every Sync answered on it) for the whole scan, while the first
        devices told could already have been syncing.
        """
        if snap.revision < self._notified:
            return 0  # an older snapshot finished loading after a newer one
        self._notified = snap.revision
        sent = 0
        watchers = list(self._by_device.values())
        for start in range(0, len(watchers), NOTIFY_SLICE):
            if start:
                await asyncio.sleep(0)
                if self._notified != snap.revision:
                    return sent  # a newer snapshot took over: it checks everyone
            for w in watchers[start : start + NOTIFY_SLICE]:
                if self._by_device.get(w.device_id) is not w:
                    continue  # closed or replaced meanwhile
                now = fingerprint(snap.desired(w.device_id, w.attrs))
                if now != w.fingerprint:
                    w.fingerprint = now
                    w.push(snap.revision)
                    sent += 1
        return sent

    async def _resync(self) -> None:
        # Changes may have been missed (listener reconnected): re-read who is still
        # allowed and what their attributes are, then recheck everyone.
        ids = list(self._by_device)
        current = await asyncio.to_thread(self._store.device_attributes, ids)
        for device_id in ids:
            w = self._by_device.get(device_id)
            if w is None:
                continue
            if device_id not in current:
                self._by_device.pop(device_id).push(_REVOKED)
            else:
                w.attrs = current[device_id]
        await self._notify_latest()

    # -- streams (on the loop) ------------------------------------------------------------

    def note_sync_threadsafe(
        self, device_id: str, attrs: Mapping, desired: Mapping[str, Desired]
    ) -> None:
        """`note_sync` from any thread (Sync runs in worker threads)."""
        # Most Syncs come from devices with no stream here: waking the loop for them cost
        # a self-pipe write per Sync. A stream opened meanwhile loads its own state.
        if self._loop is not None and device_id in self._by_device:
            self._loop.call_soon_threadsafe(self.note_sync, device_id, attrs, desired)

    def note_sync(self, device_id: str, attrs: Mapping, desired: Mapping[str, Desired]) -> None:
        """Record what a device was just told by Sync (its stream, if here, is current)."""
        w = self._by_device.get(device_id)
        if w is not None:
            w.attrs, w.fingerprint = attrs, fingerprint(desired)

    async def stream(
        self,
        device_id: str,
        revision: int,
        load: Callable[[], Awaitable[tuple[Mapping, Fingerprint]]],
    ) -> AsyncIterator[int]:
        """Yield revisions for one device until it disconnects, is revoked or reconnects.

        `load` reads the device's attributes and what it last synced (and refuses a
        revoked device); it runs after the stream is registered, so a revocation that
        commits meanwhile is either seen by `load` or closes the registered stream.
        """
        w = _Watcher(device_id, {}, frozenset())
        old = self._by_device.get(device_id)
        if old is not None:
            old.push(_REPLACED)  # one stream per device: the newer connection wins
        self._by_device[device_id] = w
        self._closed.discard(device_id)
        self._opened.add(device_id)
        try:
            w.attrs, synced = await load()
            # Fresh (loaded after the latest change): on the loop; else read in a thread.
            snap = self._resolver.current()
            if snap is None:
                snap = await asyncio.to_thread(self._resolver.snapshot)
            w.fingerprint = fingerprint(snap.desired(device_id, w.attrs))
            if w.fingerprint != synced and revision < snap.revision:
                w.push(snap.revision)  # it missed a change while it was away
            while True:
                item = await w.queue.get()
                if item == _REVOKED:
                    raise errors.PermissionDenied(f"device {device_id} is revoked")
                if item == _REPLACED:
                    return
                yield item
        finally:
            if self._by_device.get(device_id) is w:
                del self._by_device[device_id]
                self._opened.discard(device_id)
                self._closed.add(device_id)

    async def _heartbeat_loop(self) -> None:
        loop = asyncio.get_running_loop()
        next_refresh = loop.time()
        while True:
            refresh = loop.time() >= next_refresh
            try:
                await self._beat(refresh=refresh)
                if refresh:
                    next_refresh = loop.time() + self._heartbeat
            except errors.SkiffError as exc:
                log.warning("could not record online devices: %s", exc)
            await asyncio.sleep(self._flush)

    async def _beat(self, *, refresh: bool) -> None:
        closed, self._closed = list(self._closed), set()
        if closed:
            await asyncio.to_thread(self._store.set_online, closed, None)
        opened, self._opened = self._opened, set()
        ids = list(self._by_device) if refresh else [i for i in opened if i in self._by_device]
        if ids:
            until = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self._online_ttl)
            await asyncio.to_thread(self._store.set_online, ids, until)
