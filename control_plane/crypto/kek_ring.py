"""A keyring: the active KEK plus every other KEK a stored data key may be wrapped under.

New data keys are wrapped with the active KEK; an unwrap picks the KEK named by the
wrapped key's kek_id. A kek_id the ring does not hold may be one another replica just
rotated to, so the ring reloads once (from the database, through `reload`) before it
reports the key as unreadable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contract import errors
from control_plane.crypto.kek import KeyEncryptionKey
from control_plane.store.base import WrappedKey


@dataclass(frozen=True)
class _Ring:
    keks: tuple[KeyEncryptionKey, ...]
    active: KeyEncryptionKey


def _ring(keks: Sequence[KeyEncryptionKey], active_id: str) -> _Ring:
    holder = next((k for k in keks if k.holds(active_id)), None)
    if holder is None:
        raise errors.FailedPrecondition(
            f"the active KEK {active_id} is not among the KEKs this server can open"
        )
    return _Ring(tuple(keks), holder.using(active_id))


# Returns every KEK to hold and the id of the active one.
Loader = Callable[[], tuple[Sequence[KeyEncryptionKey], str]]


class KekRing(KeyEncryptionKey):
    """Wraps with the active KEK, unwraps with whichever KEK wrapped, reloads when stale."""

    def __init__(self, load: Loader) -> None:
        self._load = load
        self._reload_lock = threading.Lock()
        # Swapped whole on reload: readers on other threads see the old or the new ring.
        self._ring = _ring(*load())

    @property
    def active(self) -> KeyEncryptionKey:
        """Return the KEK new data keys are wrapped with."""
        return self._ring.active

    @property
    def keks(self) -> tuple[KeyEncryptionKey, ...]:
        """Return every KEK held."""
        return self._ring.keks

    @property
    def kek_id(self) -> str:
        """Return the active KEK's id."""
        return self._ring.active.kek_id

    @property
    def url(self) -> str:
        """Return the active KEK's URL."""
        return self._ring.active.url

    def holds(self, kek_id: str) -> bool:
        """Tell whether any KEK of the ring unwraps keys wrapped under `kek_id`."""
        return any(k.holds(kek_id) for k in self._ring.keks)

    def reload(self) -> None:
        """Reopen every KEK and re-read which one is active."""
        with self._reload_lock:
            self._ring = _ring(*self._load())

    def wrap(self, data_key: bytes, *, context: str) -> WrappedKey:
        """Wrap with the active KEK."""
        return self._ring.active.wrap(data_key, context=context)

    def unwrap(self, wrapped: WrappedKey, *, context: str) -> bytes:
        """Unwrap with the KEK named by `wrapped.kek_id`, reloading once if none holds it."""
        holder = self._holder(wrapped.kek_id)
        if holder is None:
            self.reload()
            holder = self._holder(wrapped.kek_id)
        if holder is None:
            raise errors.IntegrityError(
                f"data key was wrapped by {wrapped.kek_id}, which none of this server's KEKs holds"
            )
        return holder.unwrap(wrapped, context=context)

    def _holder(self, kek_id: str) -> KeyEncryptionKey | None:
        return next((k for k in self._ring.keks if k.holds(kek_id)), None)
