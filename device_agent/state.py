"""The agent's state directory: identity, sync position, one running agent at a time.

Layout (the directory is 0700, every file 0600, every write atomic and fsynced):

    agent.lock          held (flock) by the running agent: a second one is refused
    identity.json       device id, credential, private key set, pinned signing keys
    sync.json           last accepted revision, last sync and error (no secret)
    artifacts/          downloaded artifacts, still encrypted, by ciphertext SHA-256
    chunks/             chunks of chunked versions, still encrypted, by id (chunk_store)
    models/NAME.json    the install pointer of one model (see device_agent.install)

The private key set and the credential never leave this directory; nothing here holds
plaintext model bytes.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import errno
import fcntl
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from contract.pinned_keys import PinnedKeyRing

IDENTITY_SCHEMA = "skiff.agent-identity/v1"
LOCK_TRIES = 20  # 50 ms apart


class AgentError(Exception):
    """The agent cannot go on; the message says why in one line."""


class DamagedKeySet(AgentError):
    """The device's private key set (identity.json) does not parse: no data key unwraps.

    Not the version's fault: an install that meets it fails and is tried again (the same
    device, mended or re-enrolled, may install the same bytes).
    """


class SelfTestFailed(AgentError):
    """The version does not load or does not reproduce its golden outputs here."""


class StateLocked(AgentError):
    """Another agent holds the state directory."""


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace `path` with `data`: written beside it, fsynced, renamed, directory fsynced.

    A power cut at any instant leaves either the old file or the new one, never a mix.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of `data` to `fd` (os.write may write fewer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def fsync_dir(path: Path) -> None:
    """Make a rename or a new file in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, body: dict) -> None:
    """Atomically replace `path` with `body` as JSON (0600)."""
    atomic_write(path, (json.dumps(body, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: Path) -> dict | None:
    """Return the JSON object in `path`, None if absent; AgentError if unreadable."""
    try:
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise AgentError(f"{path} is unreadable ({exc}): restore it or start a new state") from None
    if not isinstance(body, dict):
        raise AgentError(f"{path} is not a JSON object")
    return body


@dataclass(frozen=True)
class Identity:
    """Who this device is to the control plane, and which keys it trusts."""

    server: str
    device_id: str
    credential: str = field(repr=False)
    private_keyset: bytes = field(repr=False)
    pinned: PinnedKeyRing
    attributes: dict

    def to_json(self) -> dict[str, Any]:
        """Return the body of identity.json."""
        return {
            "schema": IDENTITY_SCHEMA,
            "server": self.server,
            "device_id": self.device_id,
            "credential": self.credential,
            "private_keyset": base64.b64encode(self.private_keyset).decode(),
            "signing_keys": self.pinned.to_json(),
            "attributes": self.attributes,
        }

    @classmethod
    def from_json(cls, body: dict, where: Path) -> Identity:
        """Parse identity.json (`where` names it in errors)."""
        if body.get("schema") != IDENTITY_SCHEMA:
            raise AgentError(f"{where}: unknown identity schema {body.get('schema')!r}")
        try:
            return cls(
                server=str(body["server"]),
                device_id=str(body["device_id"]),
                credential=str(body["credential"]),
                private_keyset=base64.b64decode(body["private_keyset"], validate=True),
                pinned=PinnedKeyRing.from_json(body["signing_keys"]),
                attributes=dict(body.get("attributes") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise AgentError(f"{where}: damaged identity ({exc})") from None


@dataclass(frozen=True)
class SyncState:
    """Where the agent's sync stands; kept across restarts, shown by `agent status`."""

    revision: int = 0
    poll_interval_s: float = 300.0
    last_sync: str = ""  # ISO time of the last accepted answer
    last_error: str = ""
    last_error_at: str = ""

    def synced(self, revision: int, poll_interval_s: float) -> SyncState:
        """Return this state after an accepted answer at `revision`."""
        return replace(
            self,
            revision=revision,
            poll_interval_s=poll_interval_s or self.poll_interval_s,
            last_sync=_now(),
            last_error="",
            last_error_at="",
        )

    def failed(self, error: str) -> SyncState:
        """Return this state with `error` as the last error."""
        return replace(self, last_error=error, last_error_at=_now())


def one_line(exc: BaseException, limit: int = 300) -> str:
    """Return an error's first line (or its type's name), cut to `limit` characters."""
    return (str(exc) or type(exc).__name__).splitlines()[0][:limit]


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class StateDir:
    """One agent's state directory (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.artifacts = self.path / "artifacts"
        self.chunks = self.path / "chunks"
        self.models = self.path / "models"
        self._lock_fd: int | None = None

    def create(self) -> None:
        """Make the directory tree (0700), fixing the mode of an existing top directory.

        Group traversal (0710), if an operator granted it so that the agent's group can
        reach the local API socket, is kept; every other permission is taken away.
        """
        for d in (self.path, self.artifacts, self.chunks, self.models):
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path, 0o700 | (self.path.stat().st_mode & 0o010))

    # -- one agent at a time ----------------------------------------------------------------

    def lock(self) -> None:
        """Take the state directory for this process; StateLocked if an agent holds it."""
        self.create()
        fd = os.open(self.path / "agent.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            # `agent status` holds a shared lock for an instant: wait that out, briefly.
            for _ in range(LOCK_TRIES - 1):
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.05)
            else:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise StateLocked(
                    f"another agent (pid {holder or '?'}) is running on {self.path}"
                ) from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        """Let go of the state directory."""
        if self._lock_fd is not None:
            os.ftruncate(self._lock_fd, 0)  # no stale pid for the next reader
            os.close(self._lock_fd)  # closing drops the flock
            self._lock_fd = None

    @contextlib.contextmanager
    def locked(self) -> Iterator[StateDir]:
        """Hold the state directory for a `with` block."""
        self.lock()
        try:
            yield self
        finally:
            self.unlock()

    # -- identity and sync position ---------------------------------------------------------

    @property
    def identity_file(self) -> Path:
        """Return the path of identity.json."""
        return self.path / "identity.json"

    def load_identity(self) -> Identity | None:
        """Return the stored identity, None before enrollment."""
        body = read_json(self.identity_file)
        return None if body is None else Identity.from_json(body, self.identity_file)

    def save_identity(self, identity: Identity) -> None:
        """Store the identity (0600, atomically)."""
        write_json(self.identity_file, identity.to_json())

    def load_sync(self) -> SyncState:
        """Return the stored sync position (defaults before the first sync)."""
        body = read_json(self.path / "sync.json") or {}
        types = {"revision": int, "poll_interval_s": (int, float)}
        values = {k: v for k, v in body.items() if k in SyncState.__dataclass_fields__}
        for key, value in values.items():
            if not isinstance(value, types.get(key, str)) or isinstance(value, bool):
                raise AgentError(f"{self.path / 'sync.json'}: damaged {key!r}: delete the file")
        return SyncState(**values)

    def save_sync(self, state: SyncState) -> None:
        """Store the sync position atomically."""
        write_json(self.path / "sync.json", state.__dict__)
