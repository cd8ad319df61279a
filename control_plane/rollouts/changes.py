"""The change feed: every committed change to the fleet's desired state, in every replica.

Changes committed by this process arrive from the store right after commit. With
PostgreSQL, several replicas serve one fleet, and each change is also announced with
NOTIFY inside its transaction (delivered on commit); a listener thread per replica turns
those into the same events. A replica hears its own changes twice; the feed drops repeats.
After the listener loses its connection it may have missed changes, so it publishes a
"resync" change once it is back, and subscribers re-check everything.
"""

from __future__ import annotations

import collections
import logging
import random
import threading
from collections.abc import Callable

import psycopg
from sqlalchemy.engine import make_url

from control_plane.store.fleet import Change
from control_plane.store.sql_fleet import NOTIFY_CHANNEL
from control_plane.store.sql_store import SqlStore

log = logging.getLogger(__name__)

Subscriber = Callable[[Change], None]
_SEEN = 4096  # revisions remembered for de-duplication


class ChangeFeed:
    """Fans committed changes out to subscribers (resolver, watchers) in this process."""

    def __init__(self, store: SqlStore) -> None:
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()
        self._seen: collections.OrderedDict[int, None] = collections.OrderedDict()
        store.add_change_listener(self.publish)
        self._listener = (
            _PgListener(store.url, self.publish) if store.dialect == "postgresql" else None
        )

    def subscribe(self, subscriber: Subscriber) -> None:
        """Call `subscriber` for every new change (from whichever thread heard it)."""
        self._subscribers.append(subscriber)

    def start(self) -> None:
        """Start listening for other replicas' changes (PostgreSQL only)."""
        if self._listener is not None:
            self._listener.start()

    def close(self) -> None:
        """Stop listening."""
        if self._listener is not None:
            self._listener.stop()

    def publish(self, change: Change) -> None:
        """Deliver `change` once to every subscriber."""
        if change.kind != "resync":
            with self._lock:
                if change.revision in self._seen:
                    return
                self._seen[change.revision] = None
                while len(self._seen) > _SEEN:
                    self._seen.popitem(last=False)
        for subscriber in self._subscribers:
            try:
                subscriber(change)
            except Exception:  # noqa: BLE001 - one bad subscriber must not starve the rest
                log.exception("change subscriber failed")


class _PgListener:
    """A thread holding LISTEN on its own connection, reconnecting with backoff."""

    def __init__(self, url: str, publish: Subscriber) -> None:
        self._conninfo = (
            make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
        )
        self._publish = publish
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="skiff-listen", daemon=True)

    def start(self) -> None:
        """Start the thread and wait (briefly) until LISTEN is in place."""
        self._thread.start()
        self._ready.wait(timeout=10)

    def stop(self) -> None:
        """Ask the thread to stop and wait for it."""
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                self._listen(resync=failures > 0)
            except psycopg.Error as exc:
                failures += 1
                delay = random.uniform(0, min(10.0, 0.2 * 2**failures))
                log.warning("change listener lost PostgreSQL (%s); retrying", type(exc).__name__)
                self._stop.wait(delay)

    def _listen(self, *, resync: bool) -> None:
        with psycopg.connect(self._conninfo, autocommit=True, connect_timeout=5) as conn:
            conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self._ready.set()
            if resync:
                self._publish(Change(0, "resync"))
            while not self._stop.is_set():
                for note in conn.notifies(timeout=0.5):
                    self._publish(_parse(note.payload))


def _parse(payload: str) -> Change:
    revision, kind, subject = (payload.split(":", 2) + ["", ""])[:3]
    try:
        return Change(int(revision), kind, subject)
    except ValueError:
        return Change(0, "resync")
