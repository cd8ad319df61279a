"""`skiff init`: the embedded default in one folder (SQLite, blob dir, keys, admin token).

Also the lock (HomeLock) that keeps a second server off a home.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from contract import errors
from contract.key_files import write_private_file
from contract.pinned_keys import PinnedKeyRing
from control_plane.api.auth import ADMIN, hash_token, new_token
from control_plane.api.transport import init_tls
from control_plane.blobs.local_blob_store import LocalBlobStore
from control_plane.crypto import LocalKek, ManifestSigner
from control_plane.pins import write_pins
from control_plane.settings import CONFIG_FILE, TOKEN_FILE, Config, write_config_file

log = logging.getLogger(__name__)

# Held by the server serving the home (HomeLock); made by init, so a home mounted
# read-only, as replicas mount it, can still be locked.
LOCK_FILE = "server.lock"


@dataclass(frozen=True)
class InitResult:
    """What `init` made (paths only: the token itself stays in its 0600 file)."""

    home: Path
    config_file: Path
    token_file: Path
    kek: str
    signing_key: str
    db: str
    blobs: str
    tls_cert: str
    tls_ca: str


def init_home(config: Config, *, tls_names: Iterable[str] = ()) -> InitResult:
    """Create keys, TLS certificates, schema, admin token and config file.

    Refuses an initialised home. `tls_names` are extra host names (or addresses) for the
    generated server certificate, for clients that dial this machine over a network.
    """
    home = config.home
    if (home / CONFIG_FILE).exists():
        raise errors.AlreadyExists(f"{home} is already initialised (remove it to start over)")
    (home / "keys").mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(home, 0o700)
    (home / LOCK_FILE).touch(mode=0o600)
    config = init_tls(config, tls_names)
    if not config.blobs.startswith("s3://"):
        # The local store never creates its root (a missing root may be an unmounted
        # volume); creating the home is the one time it should exist from nothing.
        LocalBlobStore.from_url(config.blobs).root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not config.kek.startswith("aws-kms://"):
        LocalKek.create(config.kek)
    signer = ManifestSigner.create(config.signing_key)
    write_pins(home, PinnedKeyRing.from_pems([signer.public_key_pem()]))  # what `model pull` trusts
    # Deferred: every CLI command reads its token through this module, and SQLAlchemy
    # with its dialects is most of a command's start-up; only `init` needs it.
    from control_plane.store.sql_store import SqlStore

    store = SqlStore(config.db)
    try:
        token = new_token()
        store.add_token(
            name=ADMIN, role=ADMIN, token_sha256=hash_token(token), created_by="skiff init"
        )
    finally:
        store.close()
    token_file = home / TOKEN_FILE
    write_private_file(token_file, (token + "\n").encode(), replace=False)
    config_file = write_config_file(config)
    return InitResult(
        home=home,
        config_file=config_file,
        token_file=token_file,
        kek=config.kek,
        signing_key=config.signing_key,
        db=config.db,
        blobs=config.blobs,
        tls_cert=config.tls_cert,
        tls_ca=config.tls_ca,
    )


def read_token(home: Path) -> str:
    """Return the admin token: $SKIFF_TOKEN wins, else the home folder's token file."""
    token = os.environ.get("SKIFF_TOKEN", "").strip()
    if token:
        return token
    path = home / TOKEN_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise errors.Unauthenticated(
            f"no admin token: run `skiff init` or set SKIFF_TOKEN ({path} missing)"
        ) from None


class HomeLock:
    """An advisory lock (flock) on HOME/server.lock, held by a server for its whole life.

    A plain server holds it exclusively, so a second server of the same home (whose
    SQLite database would not hear the first's changes, and whose port may be taken
    silently) fails at once. Replicas started on purpose (`skiff server --replica`) share
    it, and keep a plain server out. The kernel drops the lock with its holder, however
    it dies: there is no stale pid to guess about. The file says who holds it, for the
    message only.
    """

    # What replicas write: the same words from each, so they cannot garble one another.
    REPLICAS = "servers started with --replica"

    def __init__(self, home: Path, *, shared: bool = False) -> None:
        self.path = Path(home) / LOCK_FILE
        self.shared = shared
        self._fd: int | None = None

    def acquire(self) -> HomeLock:
        """Take the lock; FailedPrecondition naming the holder if another server has it."""
        fd = self._open()
        if fd is None:
            return self
        try:
            fcntl.flock(fd, (fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip()
            os.close(fd)
            raise errors.FailedPrecondition(self._refusal(holder)) from None
        self._fd = fd
        self.describe("")
        return self

    def describe(self, address: str) -> None:
        """Record this process (and the address it listens on) for the next one's message."""
        if self._fd is None:
            return
        text = f"pid {os.getpid()}" + (f", {address}" if address else "")
        if self.shared:
            text = self.REPLICAS
        with contextlib.suppress(OSError):  # a read-only home: the message has no pid
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, text.encode(), 0)

    def release(self) -> None:
        """Let go of the home (the kernel does it anyway when the process ends)."""
        if self._fd is not None:
            if not self.shared:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, 0)  # no stale pid for the next reader
            os.close(self._fd)  # closing drops the flock
            self._fd = None

    def _open(self) -> int | None:
        try:
            return os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            home = self.path.parent
            raise errors.NotFound(f"no home {home}: run `skiff init --home {home}` first") from None
        except OSError as exc:
            if exc.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
                raise
            # A home mounted read-only (as replicas mount it): lock the file init made.
            try:
                return os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                log.warning(
                    "cannot lock %s (%s, and init made no lock file there): another server "
                    "on this home would not be refused",
                    self.path,
                    exc.strerror,
                )
                return None

    def _refusal(self, holder: str) -> str:
        who = f" ({holder})" if holder else ""
        if self.shared:
            return (
                f"{self.path.parent} is served by a skiff server{who} not started with "
                "--replica: stop it first"
            )
        if holder == self.REPLICAS:
            return (
                f"{self.path.parent} is served by skiff {holder}: start this one with "
                "--replica too, or stop them first"
            )
        return (
            f"{self.path.parent} is served by another skiff server{who}: stop it first, or "
            "start every server of this home with --replica (PostgreSQL only)"
        )
