"""The confinement of the registry's MNN children, as the parent prepares it.

Each child parses an uploaded model with native code, so it is treated as hostile once it
has read one: it starts with an empty environment (no cloud credentials, tokens or
database URL to find), no descriptors but its models, stdout/stderr and result, and a
private working directory outside the server's home. As its first act the worker calls
`runtime.hardening.confine` with the limits and user chosen here: capped address space and
CPU time, no core dumps, seccomp; and, when the server runs as root, a separate user, so
the home's 0600 key files (the KEK keyset, the signing key) are out of reach. The switch
happens in the worker after its imports, because the interpreter itself may live where
that user cannot read (a pyenv under /root).
"""

from __future__ import annotations

import contextlib
import os
import pwd
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from contract import errors

__all__ = ["DEFAULT_MEMORY_BYTES", "DEFAULT_USER", "Sandbox", "default_sandbox"]

DEFAULT_MEMORY_BYTES = 8 << 30
DEFAULT_CPU_SECONDS = 1200
DEFAULT_USER = "nobody"
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


@dataclass(frozen=True)
class Sandbox:
    """Limits and identity for MNN children; uid/gid are None when no switch applies."""

    memory_bytes: int = DEFAULT_MEMORY_BYTES
    cpu_seconds: int = DEFAULT_CPU_SECONDS
    uid: int | None = None
    gid: int | None = None

    @classmethod
    def create(
        cls,
        *,
        memory_bytes: int = DEFAULT_MEMORY_BYTES,
        cpu_seconds: float = DEFAULT_CPU_SECONDS,
        user: str = DEFAULT_USER,
    ) -> Sandbox:
        """Resolve `user` (only used when we run as root); InvalidArgument if unknown."""
        if memory_bytes <= 0 or cpu_seconds <= 0:
            raise errors.InvalidArgument("MNN memory and CPU limits must be positive")
        uid = gid = None
        if os.geteuid() == 0 and user:
            try:
                entry = pwd.getpwnam(user)
            except KeyError:
                raise errors.InvalidArgument(
                    f"mnn_user {user!r} does not exist: create it or name another"
                ) from None
            if entry.pw_uid == 0:
                raise errors.InvalidArgument(f"mnn_user {user!r} is root: name another user")
            uid, gid = entry.pw_uid, entry.pw_gid
        cpu = max(1, round(cpu_seconds))
        return cls(memory_bytes=memory_bytes, cpu_seconds=cpu, uid=uid, gid=gid)

    def worker_args(self) -> list[str]:
        """Return the worker's command-line flags that carry these limits."""
        args = ["--memory-limit", str(self.memory_bytes), "--cpu-limit", str(self.cpu_seconds)]
        if self.uid is not None:
            args += ["--uid", str(self.uid), "--gid", str(self.gid)]
        return args

    @contextlib.contextmanager
    def workdir(self) -> Iterator[str]:
        """Yield a private, empty directory for one child, owned by the child's user.

        MNN's converter insists on a scratch file in its working directory (the worker
        points it at a memfd). The directory lives under the system's temp folder, never
        in the server's home, and is removed with whatever the child left.

        When children switch to a shared user, that user's other processes (another
        child, compromised by an earlier model) must not find this directory: they could
        plant modules in it or swap the scratch link to steal weights. So it sits, under
        a random name, inside a parent only we may list (0711: others may pass through
        it, to the one name they were told, but not read it).
        """
        with tempfile.TemporaryDirectory(prefix="skiff-mnn-") as parent:
            os.chmod(parent, 0o711 if self.uid is not None else 0o700)
            scratch = tempfile.mkdtemp(dir=parent)
            if self.uid is not None:
                os.chown(scratch, self.uid, self.gid)
            yield scratch

    def describe_limit(self, kind: str) -> str:
        """Name a limit the way an error message should."""
        if kind == "cpu":
            return f"its {self.cpu_seconds} s CPU limit (mnn_cpu_limit_s)"
        return f"its {self.memory_bytes / (1 << 30):.1f} GiB memory limit (mnn_memory_limit_bytes)"


def child_env() -> dict[str, str]:
    """Return the child's whole environment: only where to find our package.

    Nothing of the server's environment is passed on: it holds cloud credentials, tokens
    and database URLs that a compromised converter must not find.
    """
    return {"PYTHONPATH": _PACKAGE_ROOT}


_default: Sandbox | None = None


def default_sandbox() -> Sandbox:
    """Return the sandbox with default limits and user (resolved once)."""
    global _default
    if _default is None:
        _default = Sandbox.create()
    return _default
