"""Blob store on a local or mounted filesystem (``file:///abs/dir`` or a plain path).

Layout is ``root/ab/cd/<hex>``. Writes stream into ``root/.tmp`` (same filesystem, so
the final rename is atomic), fsync, verify the digest, then ``os.replace`` and fsync
the directory: a blob is either absent or complete, even across a crash.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from urllib.parse import unquote, urlsplit

from contract.errors import InvalidArgument, NotFound, Unavailable
from contract.key_files import fsync_directory
from control_plane.blobs.base import (
    BlobInfo,
    BlobStore,
    StoredBlob,
    check_key,
    check_offset,
    hash_chunks,
    is_key,
    iter_file,
    verify_digest,
)

_TMP_DIR = ".tmp"
_DIR_MODE = 0o700
_FANOUT_RE = re.compile(r"[0-9a-f]{2}")


class LocalBlobStore(BlobStore):
    """Content-addressed blobs under a root directory that must already exist.

    The root itself is never created: a missing root usually means an unmounted
    volume, and writing into the bare mount point would silently lose blobs.
    """

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(os.path.abspath(root))

    @classmethod
    def from_url(cls, url: str) -> LocalBlobStore:
        """Build a store from ``file:///abs/dir`` (host empty or localhost) or a plain path."""
        parts = urlsplit(url)
        if not parts.scheme:
            return cls(url)
        if (
            parts.scheme != "file"
            or parts.netloc not in ("", "localhost")
            or parts.query
            or not parts.path
        ):
            raise InvalidArgument(f"unsupported local blob store URL {url!r}")
        return cls(unquote(parts.path))

    def put_stream(self, chunks: Iterable[bytes], *, refresh: bool = False) -> BlobInfo:
        """Store the concatenated chunks under their SHA-256."""
        return self._put(chunks, None)

    def open_read(self, key: str, *, offset: int = 0) -> Iterator[bytes]:
        """Return chunks of the blob from ``offset`` to the end."""
        path = self._path(check_key(key))
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise self._missing(key) from None
        except OSError as exc:
            raise self._unavailable(f"open blob {key}", exc) from exc
        try:
            check_offset(offset, os.fstat(f.fileno()).st_size, key)
            f.seek(offset)
        except BaseException:
            f.close()
            raise
        return iter_file(f)

    def stat(self, key: str) -> BlobInfo:
        """Return the blob's size; raise NotFound if it is missing."""
        try:
            st = os.stat(self._path(check_key(key)))
        except FileNotFoundError:
            raise self._missing(key) from None
        except OSError as exc:
            raise self._unavailable(f"stat blob {key}", exc) from exc
        return BlobInfo(key=key, size=st.st_size)

    def exists(self, key: str) -> bool:
        """Return whether the blob is published."""
        try:
            self.stat(key)
        except NotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        """Remove the blob if present.

        Empty fan-out directories are kept: removing them would race a concurrent
        put that has just created its target directory.
        """
        try:
            os.unlink(self._path(check_key(key)))
        except FileNotFoundError:
            self._require_root()
        except OSError as exc:
            raise self._unavailable(f"delete blob {key}", exc) from exc

    def keys(self) -> Iterator[str]:
        """Yield every published key; ``.tmp`` and stray files are skipped."""
        self._require_root()
        return (entry.name for entry in self._walk())

    def list_blobs(self) -> Iterator[StoredBlob]:
        """Yield every published blob with its size and mtime."""
        self._require_root()
        for entry in self._walk():
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue  # deleted since it was listed
            modified = dt.datetime.fromtimestamp(st.st_mtime, dt.UTC)
            yield StoredBlob(key=entry.name, size=st.st_size, modified=modified)

    def check(self) -> None:
        """Raise Unavailable unless the root exists and is writable."""
        self._require_root()
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise Unavailable(f"local blob store root {self.root} is not writable")

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / key[2:4] / key

    def _put(self, chunks: Iterable[bytes], expected: str | None) -> BlobInfo:
        tmp, info = self._spool(chunks)
        try:
            verify_digest(expected, info.key)
            self._publish(tmp, info.key)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return info

    def _spool(self, chunks: Iterable[bytes]) -> tuple[str, BlobInfo]:
        tmp_dir = self.root / _TMP_DIR
        with self._os_errors("create a temp file"):
            _mkdir(tmp_dir)
            fd, tmp = tempfile.mkstemp(dir=tmp_dir)  # mode 0o600
        try:
            with os.fdopen(fd, "wb") as out:
                info = hash_chunks(chunks, out)
                with self._os_errors("sync a temp file"):
                    out.flush()
                    os.fsync(out.fileno())
        except BaseException:
            _unlink_quietly(tmp)
            raise
        return tmp, info

    def _publish(self, tmp: str, key: str) -> None:
        dest = self._path(key)
        with self._os_errors(f"publish blob {key}"):
            _mkdir(dest.parent.parent)
            _mkdir(dest.parent)
            # Same content under the same name, so replacing an existing blob is harmless.
            os.replace(tmp, dest)
            fsync_directory(dest.parent)

    def _walk(self) -> Iterator[os.DirEntry]:
        for d1 in _fanout_dirs(self.root):
            for d2 in _fanout_dirs(d1.path):
                for entry in os.scandir(d2.path):
                    name = entry.name
                    if name[:4] == d1.name + d2.name and is_key(name) and entry.is_file():
                        yield entry

    def _require_root(self) -> None:
        if not self.root.is_dir():
            raise Unavailable(f"local blob store root {self.root} is missing")

    def _missing(self, key: str) -> NotFound:
        """Return NotFound for ``key``, or raise Unavailable if the whole root is gone."""
        self._require_root()
        return NotFound(f"blob {key} not found")

    def _unavailable(self, what: str, exc: OSError) -> Unavailable:
        return Unavailable(f"local blob store {self.root}: cannot {what}: {exc.strerror or exc}")

    @contextlib.contextmanager
    def _os_errors(self, what: str) -> Iterator[None]:
        try:
            yield
        except OSError as exc:
            self._require_root()
            raise self._unavailable(what, exc) from exc


def _fanout_dirs(path: str | os.PathLike) -> Iterator[os.DirEntry]:
    for entry in os.scandir(path):
        if _FANOUT_RE.fullmatch(entry.name) and entry.is_dir():
            yield entry


def _mkdir(path: Path) -> None:
    """Create one directory level (never the root) and make its entry durable."""
    try:
        os.mkdir(path, _DIR_MODE)
    except FileExistsError:
        return
    fsync_directory(path.parent)


def _unlink_quietly(path: str) -> None:
    # Cleanup after a failure must not mask the original error.
    with contextlib.suppress(OSError):
        os.unlink(path)
