"""Garbage collection: delete blobs no version references, once no push can still claim them.

A push writes its blobs first and commits its version row last; a crash in between
leaves blobs nothing references. A sweep must not mistake a push in flight for such an
orphan, on this replica or another. The rule that makes that safe:

* A push refuses to commit once `grace / 2` has passed since it started writing blobs
  (`Registry._store_version`), so a blob's row is committed within `grace / 2` of the
  blob's write, or never.
* A sweep takes the time `now` first, then lists blobs, then reads the referenced set.
  It deletes an unreferenced blob only if it was written before `now - grace`. Such a
  blob's push committed (if ever) before `now - grace / 2`, that is before the sweep read
  the references, so the sweep would have seen the row. The other half of the grace
  covers clock skew between replicas and the blob store, and the commit itself.
* Sweeps racing each other only delete the same orphans twice (delete is idempotent).
* Content addresses cannot come back, except chunks: each version is encrypted under a
  fresh random data key, so a new push never writes a ciphertext an older orphan already
  has (an S3 put of an existing key is skipped and would not refresh its LastModified).
  A chunk's ciphertext is the same in every version of its model, so a push rewrites
  (refreshes) every chunk no committed version names, and any named chunk the store no
  longer has: a sweep that deletes one between its listing and a racing push's commit
  costs that version its install (the device says which chunk) until the next push of the
  model puts it back.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass

from contract import errors
from control_plane.blobs import BlobStore
from control_plane.registry import mnn_tools
from control_plane.store.base import RegistryStore

log = logging.getLogger(__name__)

# The slowest rate a push may encrypt and store a variant at (bytes/s): well under the
# ~0.85 GB/s of Tink's encryption and a slow S3 upload alike.
MIN_STORE_RATE = 16 << 20
# Signing, commit retries and waiting for the KEK lock after the last MNN job.
COMMIT_ALLOWANCE_S = 300.0


def longest_push_s(*, mnn_timeout_s: float, max_model_bytes: int) -> float:
    """Return how long a push can take from its first blob write to its commit.

    After the first blob is written, a push stores every variant (the base and each
    derivable one, none bigger than the largest upload) and waits for each variant's
    golden run (counted one after another, though two run at once), plus one more MNN
    timeout of slack:

        variants * (mnn_timeout_s + max_model_bytes / MIN_STORE_RATE)
            + mnn_timeout_s + COMMIT_ALLOWANCE_S
    """
    variants = 1 + len(mnn_tools.VARIANTS)
    stores = variants * (mnn_timeout_s + max_model_bytes / MIN_STORE_RATE)
    return stores + mnn_timeout_s + COMMIT_ALLOWANCE_S


def default_grace_s(*, mnn_timeout_s: float, max_model_bytes: int) -> float:
    """Return the grace period: twice the longest push (see the module docstring)."""
    return 2 * longest_push_s(mnn_timeout_s=mnn_timeout_s, max_model_bytes=max_model_bytes)


@dataclass(frozen=True)
class GcResult:
    """What a sweep deleted (or, on a dry run, would delete)."""

    blobs: tuple[str, ...]
    bytes: int
    kept_young: int
    dry_run: bool


def collect_garbage(
    store: RegistryStore,
    blobs: BlobStore,
    *,
    grace_s: float,
    dry_run: bool = False,
    clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
) -> GcResult:
    """Delete unreferenced blobs written more than `grace_s` ago; keep younger ones."""
    cutoff = clock() - dt.timedelta(seconds=grace_s)  # before listing and reading refs
    listed = list(blobs.list_blobs())
    referenced = store.referenced_blobs()
    doomed, kept_young = [], 0
    for blob in listed:
        if blob.key in referenced:
            continue
        if blob.modified >= cutoff:
            kept_young += 1
        else:
            doomed.append(blob)
    deleted = []
    for blob in doomed:
        if not dry_run:
            try:
                blobs.delete(blob.key)
            except errors.SkiffError as exc:
                log.warning("garbage collection: cannot delete blob %s: %s", blob.key, exc)
                continue
        deleted.append(blob)
    if deleted and not dry_run:
        log.info(
            "garbage collection: deleted %d unreferenced blobs (%d bytes)",
            len(deleted),
            sum(b.size for b in deleted),
        )
    return GcResult(
        blobs=tuple(sorted(b.key for b in deleted)),
        bytes=sum(b.size for b in deleted),
        kept_young=kept_young,
        dry_run=dry_run,
    )
