"""Process hardening for anything that holds plaintext models or parses untrusted ones.

Two kinds of process use this. Long-lived ones that hold plaintext (the control-plane
server, the device runtime's workers, and any process that loads a `runtime.Model`, from
`Model.from_bytes`) call `forbid_core_dumps`, so a crash writes no core file and
unprivileged peers cannot ptrace them. Throwaway children that
feed untrusted bytes to native code (the registry's MNN worker) also call `confine` once
they have imported everything they need and before they read the untrusted input: it
caps memory and CPU, drops to an unprivileged user when started as root, and installs a
seccomp filter so that code which takes over the process cannot reach the network, start
programs or attack the kernel's rarer interfaces.

prctl has no maintained Python binding (python-prctl stopped at Python 3.7 and needs a
compiler); it is one libc call with integer arguments, so ctypes on libc is the smaller
risk. Seccomp goes through libseccomp, the library systemd and container runtimes use,
via `pyseccomp` (a ctypes binding with libseccomp's own Python API). Where libseccomp or
the kernel's seccomp is missing, `confine` reports why instead of failing: the other
layers still apply.
"""

from __future__ import annotations

import ctypes
import errno
import os
import resource
from dataclasses import dataclass
from types import ModuleType

__all__ = ["Confinement", "confine", "forbid_core_dumps", "is_dumpable"]

_PR_GET_DUMPABLE = 3  # <linux/prctl.h>
_PR_SET_DUMPABLE = 4
_CLONE_THREAD = 0x00010000  # <linux/sched.h>
# Seconds between RLIMIT_CPU's soft limit (SIGXCPU, which the worker reports) and its hard
# limit (SIGKILL, should SIGXCPU be ignored).
_CPU_GRACE_S = 5

# Denied with EPERM once confined. The default stays "allow": an allow-list would have to
# track every syscall Python, numpy, protobuf and MNN's thread pools make, and breaks with
# their upgrades. These are what a parser of model files never needs and an exploit wants:
# a way out (network, other programs, other processes' memory) or into the kernel through
# its less-travelled interfaces.
DENIED_SYSCALLS = (
    # the network (any socket at all: a converter has nobody to talk to)
    "socket",
    "socketpair",
    # other programs and other processes
    "execve",
    "execveat",
    "fork",
    "vfork",
    "ptrace",
    "process_vm_readv",
    "process_vm_writev",
    "pidfd_getfd",
    # namespaces, mounts and privileges
    "unshare",
    "setns",
    "mount",
    "umount2",
    "pivot_root",
    "chroot",
    "personality",
    # rarely used kernel interfaces with a history of privilege-escalation bugs
    "bpf",
    "perf_event_open",
    "userfaultfd",
    "io_uring_setup",
    "io_uring_enter",
    "io_uring_register",
    "keyctl",
    "add_key",
    "request_key",
    "init_module",
    "finit_module",
    "delete_module",
    "kexec_load",
    "kexec_file_load",
    "reboot",
    "swapon",
    "swapoff",
    "acct",
)


def forbid_core_dumps() -> None:
    """Make this process write no core file and refuse ptrace from unprivileged peers."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if _prctl(_PR_SET_DUMPABLE, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def is_dumpable() -> bool:
    """Return whether this process may write a core file or be ptraced by its user."""
    return _prctl(_PR_GET_DUMPABLE, 0) != 0


@dataclass(frozen=True)
class Confinement:
    """What `confine` put in place, for the parent to check and log."""

    uid: int
    memory_bytes: int
    cpu_seconds: int
    seccomp: str  # "on", or why it is off

    def to_dict(self) -> dict[str, int | str]:
        """Return a JSON-able dict."""
        return {
            "uid": self.uid,
            "memory_bytes": self.memory_bytes,
            "cpu_seconds": self.cpu_seconds,
            "seccomp": self.seccomp,
        }


def confine(
    *, memory_bytes: int, cpu_seconds: int, uid: int | None = None, gid: int | None = None
) -> Confinement:
    """Confine this process for good: undumpable, capped, unprivileged, filtered.

    Call it after every import the process needs (a dropped user may not be able to read
    the interpreter's own files) and before touching untrusted input. `uid`/`gid` are
    switched to (all supplementary groups dropped) when given; that needs root. Raises
    OSError if a limit or the user switch fails: running unconfined is never the fallback.
    """
    forbid_core_dumps()
    # libseccomp is found by running ldconfig: before exec is denied and the user switched.
    seccomp = _load_seccomp()
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds + _CPU_GRACE_S))
    if uid is not None and gid is not None:
        _switch_user(uid, gid)
    return Confinement(
        uid=os.getuid(),
        memory_bytes=memory_bytes,
        cpu_seconds=cpu_seconds,
        seccomp=_deny_syscalls(seccomp) if isinstance(seccomp, ModuleType) else seccomp,
    )


def _switch_user(uid: int, gid: int) -> None:
    """Become `uid`/`gid` with no supplementary groups, irreversibly (checked)."""
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    if uid != 0:
        try:
            os.setuid(0)
        except PermissionError:
            pass
        else:
            raise OSError(errno.EPERM, "could regain root after dropping privileges")
    # Changing uid resets the dumpable flag to the system default: set it again.
    forbid_core_dumps()


def _load_seccomp() -> ModuleType | str:
    """Return the libseccomp binding, or why it cannot be had."""
    try:
        import pyseccomp
    except (ImportError, OSError, RuntimeError) as exc:  # RuntimeError: no libseccomp
        return f"off: libseccomp is not available ({exc})"
    return pyseccomp


def _deny_syscalls(pyseccomp: ModuleType) -> str:
    """Install the seccomp filter on every thread; return "on" or why it is off."""
    try:
        rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        # Threads started by imports (BLAS, MNN's pool) must be filtered too.
        rules.set_attr(pyseccomp.Attr.CTL_TSYNC, 1)
        denied = pyseccomp.ERRNO(errno.EPERM)
        for name in DENIED_SYSCALLS:
            rules.add_rule(denied, name)
        # New threads are fine; a new process (clone without CLONE_THREAD) is not. clone3
        # passes its flags in memory a filter cannot read: ENOSYS makes libc use clone.
        no_thread = pyseccomp.Arg(0, pyseccomp.MASKED_EQ, _CLONE_THREAD, 0)
        rules.add_rule(denied, "clone", no_thread)
        rules.add_rule(pyseccomp.ERRNO(errno.ENOSYS), "clone3")
        rules.load()  # also sets no_new_privs: nothing can gain privileges afterwards
    except OSError as exc:
        return f"off: the kernel refused the filter ({exc})"
    return "on"


def _prctl(option: int, arg: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(option, arg, 0, 0, 0)
