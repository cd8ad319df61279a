"""The KEK state every replica shares, and KEK rotation.

The database holds which KEK wraps new data keys and the URLs of every other KEK a stored
data key may be wrapped under; each server's `skiff.json` keeps the same keyring, so a
config file alone still opens every data key. A rotation:

1. takes the database-wide rotation lock (two rotations never interleave);
2. checks the new KEK wraps and unwraps (a KMS that refuses stops it here, with nothing
   written);
3. adds the new KEK to the keyring (database, then config file) before any data key moves;
4. re-wraps data keys in batches, each KMS call outside any transaction and each batch
   stored in a short transaction of its own, so other writers keep working;
5. activates the new KEK in one transaction, only once no data key is left under another
   (a push that wrapped under the old KEK and committed meanwhile sends it back to 4);
6. records the new active KEK in the config file and retires the old local keys.

A crash anywhere leaves every data key readable, and running the rotation again finishes
it. Pushes check the active KEK in the transaction that inserts their version (see
`RegistryStore.create_version`), so none lands under a KEK the rotation has retired.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from contract import errors
from control_plane.crypto import KeyEncryptionKey, LocalKek
from control_plane.crypto.kek_ring import KekRing
from control_plane.store.base import KekState, RegistryStore, chunk_secret_context

log = logging.getLogger(__name__)

# Data keys re-wrapped per transaction: two KMS calls each, done before the transaction.
REWRAP_BATCH = 100
# Passes over the rows left under another KEK before giving up to a steady push stream.
ACTIVATE_ATTEMPTS = 20

# Opens a KEK URL with the server's KMS settings (never settings from a request).
Opener = Callable[[str], KeyEncryptionKey]
# Records the active KEK URL and the keyring in this server's config file.
Persist = Callable[[str, tuple[str, ...]], None]


@dataclass(frozen=True)
class Rotated:
    """What a rotation did."""

    old_kek_id: str
    new_kek_id: str
    rewrapped: int


def open_keyring(
    store: RegistryStore, opener: Opener, *, kek: str, keyring: Sequence[str] = ()
) -> KekRing:
    """Open the KEKs of the config (`kek`, `keyring`) and of the database's KEK state.

    The database names the active KEK: another replica may have rotated since this
    server's config file was written. A database without KEK state gets this config's.
    """

    def load() -> tuple[list[KeyEncryptionKey], str]:
        state = store.kek_state()
        if state is None:
            first = opener(kek)
            state = store.init_kek_state(KekState(first.kek_id, first.url, tuple(keyring)))
        keks = []
        for url in dict.fromkeys((state.active_url, kek, *state.keyring, *keyring)):
            try:
                keks.append(opener(url))
            except errors.NotFound as exc:
                # A retired key file may be gone; data keys under it fail by name later.
                # (A malformed URL is not skipped: the operator has a setting to fix.)
                log.warning("cannot open KEK %s from the keyring: %s", url, exc)
        return keks, state.active_kek_id

    return KekRing(load)


class KekRotation:
    """Moves every data key to a new KEK, safely against crashes and other replicas."""

    def __init__(
        self,
        store: RegistryStore,
        keyring: KekRing,
        *,
        opener: Opener,
        persist: Persist,
        batch_size: int = REWRAP_BATCH,
    ) -> None:
        self._store, self._keyring = store, keyring
        self._open, self._persist = opener, persist
        self._batch = batch_size

    def run(self, target: str, *, progress: Callable[[int], None] | None = None) -> Rotated:
        """Rotate to `target` ("" = a new key in the local keyset, or ``aws-kms://KEY``).

        `progress` is called with the running count after every stored batch.
        """
        with self._store.kek_rotation_lock():
            self._keyring.reload()  # another replica may have rotated since we loaded
            old = self._keyring.active
            new = self._new_kek(target, old)
            new.check()
            self._record(self._store.add_to_keyring(new.url))
            self._keyring.reload()  # holds `new` now (and so does every replica that reloads)
            moved = self._move_everything(new, progress or (lambda _: None))
            state = self._store.kek_state()
            assert state is not None
            self._keyring.reload()
            self._record(state)
            if isinstance(new, LocalKek) and isinstance(old, LocalKek) and new.path == old.path:
                new.retire_old_keys()
        log.info("re-wrapped %d data keys from %s to %s", moved, old.kek_id, new.kek_id)
        return Rotated(old.kek_id, new.kek_id, moved)

    def _new_kek(self, target: str, old: KeyEncryptionKey) -> KeyEncryptionKey:
        if not target:
            if not isinstance(old, LocalKek):
                raise errors.InvalidArgument(
                    "the active KEK is not a local key file: name the new KEK"
                )
            return old.add_key()  # on disk, but not the file's primary yet
        if not target.startswith("aws-kms://"):
            raise errors.InvalidArgument(
                "the new KEK is either empty (a new local key) or aws-kms://KEY"
            )
        return self._open(target)

    def _move_everything(self, new: KeyEncryptionKey, progress: Callable[[int], None]) -> int:
        moved = 0
        for _ in range(ACTIVATE_ATTEMPTS):
            moved = self._rewrap_pass(new, moved, progress)
            if self._store.activate_kek(new.kek_id, new.url) == 0:
                return moved
        raise errors.Unavailable(
            f"data keys kept arriving under the old KEK; {new.kek_id} is in the keyring but"
            " not active yet: run the rotation to it again"
        )

    def _rewrap_pass(
        self, new: KeyEncryptionKey, moved: int, progress: Callable[[int], None]
    ) -> int:
        after = 0
        while batch := self._store.data_keys_not_under(new.kek_id, after=after, limit=self._batch):
            moves = [
                (
                    s,
                    new.wrap(self._keyring.unwrap(s.data_key, context=s.uid), context=s.uid),
                    # The model's chunk secret moves with the data key: same row, same KEK.
                    None
                    if s.chunk_secret is None
                    else new.wrap(
                        self._keyring.unwrap(s.chunk_secret, context=chunk_secret_context(s.uid)),
                        context=chunk_secret_context(s.uid),
                    ),
                )
                for s in batch
            ]
            moved += self._store.replace_data_keys(moves)
            after = batch[-1].row_id
            progress(moved)
        return moved

    def _record(self, state: KekState) -> None:
        self._persist(state.active_url, state.keyring)
