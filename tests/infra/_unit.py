"""Checks of the systemd unit, env files and the README's command lines."""

from __future__ import annotations

import re
import shlex
from pathlib import PurePosixPath

from tests.infra._commands import Problem, check_commands, home_of, runs, skiff_argvs_in_script

_ENV_LINE = re.compile(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$")
_TRUE = frozenset({"yes", "true", "1", "on"})
# What the design asks of the server unit (key -> value, "yes" standing for any boolean).
_UNIT_REQUIRED = {
    "User": "skiff",
    "ProtectSystem": "strict",
    "NoNewPrivileges": "yes",
    "PrivateTmp": "yes",
    "LimitCORE": "0",
}


def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """Return a unit file's sections as ordered (key, value) lists (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    for line in text.replace("\\\n", " ").splitlines():
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), [])
        elif current is not None:
            key, _, value = line.partition("=")
            current.append((key.strip(), value.strip()))
    return sections


def check_unit(text: str, where: str) -> list[Problem]:
    """Check the server unit: its commands parse and the hardening the design needs is on."""
    entries = parse_unit(text).get("Service", [])
    service = dict(entries)  # the last of a repeated key, as systemd reads these ones
    argvs = [shlex.split(v.lstrip("-@:+!|")) for k, v in entries if k.startswith("Exec")]
    problems = check_commands(argvs, where)
    for key, want in _UNIT_REQUIRED.items():
        have = service.get(key)
        if ("yes" if str(have).lower() in _TRUE else have) != want:
            problems.append(Problem(where, f"{key}={have}; want {want}"))
    nofile = service.get("LimitNOFILE", "")
    if not nofile.isdigit() or int(nofile) < 65_536:
        problems.append(Problem(where, f"LimitNOFILE={nofile}: each device stream needs an fd"))
    writable = service.get("ReadWritePaths", "").split()
    servers = [a for argv in argvs for a in runs(argv, "server")]
    if not servers:
        problems.append(Problem(where, "no Exec line runs `skiff server`"))
    for argv in servers:
        home, found = home_of(argv, where)
        problems += found
        if home and not any(PurePosixPath(home).is_relative_to(p) for p in writable):
            problems.append(Problem(where, f"home {home} is not in ReadWritePaths {writable}"))
    return problems


_AGENT_REQUIRED = {**_UNIT_REQUIRED, "User": "skiff-agent"}


def check_agent_unit(text: str, where: str) -> list[Problem]:
    """Check the agent unit: its command parses, runs the agent, and hardening is on."""
    entries = parse_unit(text).get("Service", [])
    service = dict(entries)
    argvs = [shlex.split(v.lstrip("-@:+!|")) for k, v in entries if k.startswith("Exec")]
    problems = check_commands(argvs, where)
    for key, want in _AGENT_REQUIRED.items():
        have = service.get(key)
        if ("yes" if str(have).lower() in _TRUE else have) != want:
            problems.append(Problem(where, f"{key}={have}; want {want}"))
    agents = [a for argv in argvs for a in runs(argv, "agent")]
    if not agents:
        problems.append(Problem(where, "no Exec line runs `skiff agent run`"))
    writable = service.get("ReadWritePaths", "").split()
    for argv in agents:
        state = argv[argv.index("--state") + 1] if "--state" in argv else None
        if state is None:
            problems.append(Problem(where, "`skiff agent run` without --state"))
        elif not any(PurePosixPath(state).is_relative_to(p) for p in writable):
            problems.append(Problem(where, f"state {state} is not in ReadWritePaths {writable}"))
    return problems


def env_file_entries(text: str) -> dict[str, str]:
    """Return the VAR=value lines of an env file, commented-out examples included."""
    return {m[1]: m[2] for line in text.splitlines() if (m := _ENV_LINE.match(line.strip()))}


def readme_argvs(text: str) -> list[list[str]]:
    """Return the `skiff` argument lists run by the fenced code blocks of a README."""
    found, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced:
            found += skiff_argvs_in_script(line.split(" #", 1)[0])
    return found
