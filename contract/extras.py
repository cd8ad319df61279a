"""Which of skiff's parts this install holds, read from its installed metadata.

One `pyproject.toml`, two installs: `pip install skiff` is the device side, and
`skiff[server]` adds what the control plane and the operator's commands need. The parts
reach each other through skiff's own entry points ("skiff.cli", "skiff.commands",
"skiff.http") rather than imports, and only skiff's own count: another installed package
registering the same group can neither take over a command nor the dashboard, nor break
them.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

DISTRIBUTION = "skiff"
SERVER_EXTRA = "server"
# The device side's own commands (device_agent.cli): they need nothing of the server.
DEVICE_COMMANDS = frozenset({"agent", "infer", "generate"})


def entry_points(**selection):
    """Return `importlib.metadata.entry_points(**selection)`.

    importlib.metadata is imported here, on first use, not with this module: it brings
    email, csv and zipfile along (about 1 MB resident), and the device agent, which
    imports this module for its command line, never looks up an entry point.
    """
    from importlib.metadata import entry_points as found

    return found(**selection)


def own_entry_points(group: str, name: str | None = None) -> list[EntryPoint]:
    """Return skiff's own entry points of `group` (and `name`), sorted by name."""
    found = entry_points(group=group) if name is None else entry_points(group=group, name=name)
    mine = [e for e in found if e.dist is not None and e.dist.name.lower() == DISTRIBUTION]
    return sorted(mine, key=lambda e: e.name)


def missing_requirements(extra: str, *, nested: bool = False) -> list[str]:
    """Return what `extra` of skiff requires that is not installed (or too old).

    Only the extra's own requirements, unless `nested` (then the extras it names of skiff,
    `skiff[postgres,s3]`, too). Read from the installed metadata with `packaging`, as pip
    does, once per process (`skiff` and the operator's command line both ask);
    PackageNotFoundError when skiff itself is not installed (a bare checkout).
    """
    return list(_missing(extra, nested))


def operator_refusal(command: str) -> str | None:
    """Return the one line that refuses `skiff COMMAND` here, or None if it can run.

    The operator's commands need the server extra's own requirements; the extras it
    includes (postgres, s3, dashboard, convert) are checked where they are used.
    """
    from importlib.metadata import PackageNotFoundError

    try:
        missing = missing_requirements(SERVER_EXTRA)
    except PackageNotFoundError:
        return None  # a bare checkout: nothing installed to judge by
    if not missing:
        return None
    own = {r.name for r in _requirements() if _of_extra(r, SERVER_EXTRA)} - {DISTRIBUTION}
    where = (
        "this install has the device side only"
        if own <= set(missing)
        else f"this install lacks {', '.join(missing)}"
    )
    return (
        f"skiff: 'skiff {command}' is an operator command, and {where}: "
        f"pip install '{DISTRIBUTION}[{SERVER_EXTRA}]'"
    )


@functools.cache
def _requirements() -> tuple:
    """Return skiff's installed requirements, parsed (packaging.requirements.Requirement)."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    return tuple(Requirement(line) for line in requires(DISTRIBUTION) or ())


def _of_extra(req, extra: str) -> bool:
    """Tell whether `req` is `extra`'s own: its marker holds with it, not without any."""
    marker = req.marker
    return (
        marker is not None
        and marker.evaluate({"extra": extra})
        and not marker.evaluate({"extra": ""})
    )


@functools.cache
def _missing(extra: str, nested: bool) -> tuple[str, ...]:
    from importlib.metadata import PackageNotFoundError, distribution, version

    wanted, seen, missing = [extra], set(), []
    while wanted:
        current = wanted.pop()
        if current in seen:
            continue
        seen.add(current)
        for req in _requirements():
            if not _of_extra(req, current):
                continue
            if req.name.lower() == DISTRIBUTION:
                if nested:
                    wanted += sorted(req.extras)
                continue
            try:
                distribution(req.name)
                ok = req.specifier.contains(version(req.name), prereleases=True)
            except PackageNotFoundError:
                ok = False
            if not ok and req.name not in missing:
                missing.append(req.name)
    return tuple(missing)
