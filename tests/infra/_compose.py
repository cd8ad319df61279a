"""Checks of the image (infra/Dockerfile) and the compose file."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence

from tests.infra._commands import (
    Problem,
    bind_problems,
    check_commands,
    check_env_values,
    grpc_address,
    home_of,
    parse_skiff_argv,
    runs,
    volume_holding,
)


def dockerfile_argv(text: str) -> list[str]:
    """Return the image's default process: ENTRYPOINT followed by CMD (last of each)."""
    found: dict[str, list[str]] = {}
    for line in text.replace("\\\n", " ").splitlines():
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() in ("CMD", "ENTRYPOINT"):
            rest = rest.strip()
            found[keyword.upper()] = (
                json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
            )
    return found.get("ENTRYPOINT", []) + found.get("CMD", [])


def _words(value: object) -> list[str]:
    """Compose accepts a command as a list or as one string."""
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


def compose_argv(service: Mapping, image_argv: Sequence[str]) -> list[str]:
    """Return the process a compose service runs (entrypoint + command, else the image's)."""
    entrypoint, command = _words(service.get("entrypoint")), _words(service.get("command"))
    if entrypoint:
        return entrypoint + command
    return command or (list(image_argv) if "build" in service else [])


def _healthcheck_argv(service: Mapping) -> list[str]:
    test = (service.get("healthcheck") or {}).get("test") or []
    if isinstance(test, str) or test[:1] == ["CMD-SHELL"]:
        return ["/bin/sh", "-c", test if isinstance(test, str) else " ".join(test[1:])]
    return [str(word) for word in test[1:]]  # past "CMD"


def _env(value: object) -> dict[str, str]:
    if isinstance(value, Mapping):
        return {k: "" if v is None else str(v) for k, v in value.items()}
    return dict(item.partition("=")[::2] for item in value or ())


def _depends_on(service: Mapping) -> dict[str, Mapping | None]:
    depends = service.get("depends_on") or {}
    return dict(depends) if isinstance(depends, Mapping) else dict.fromkeys(depends)


def _mounts(service: Mapping) -> list[tuple[str | None, str]]:
    mounts = []
    for item in service.get("volumes") or ():
        if isinstance(item, Mapping):
            mounts.append((item.get("source"), item["target"]))
        else:
            parts = item.split(":")
            mounts.append((parts[0], parts[1]) if len(parts) > 1 else (None, parts[0]))
    return mounts


def _container_ports(service: Mapping) -> set[int]:
    ports = set()
    for item in service.get("ports") or ():
        target = item["target"] if isinstance(item, Mapping) else str(item).rsplit(":", 1)[-1]
        ports.add(int(str(target).split("/")[0]))
    return ports


def check_compose(doc: Mapping, image_argv: Sequence[str], where: str) -> list[Problem]:
    """Check a compose model: commands, settings, depends_on, and the replicas' sharing."""
    services: Mapping[str, Mapping] = doc.get("services") or {}
    argvs = {name: compose_argv(svc, image_argv) for name, svc in services.items()}
    problems: list[Problem] = []
    inits = {}
    for name, svc in services.items():
        at = f"{where}#{name}"
        problems += check_env_values(_env(svc.get("environment")), at)
        problems += check_commands([argvs[name], _healthcheck_argv(svc)], at)
        problems += _check_depends_on(svc, services, at)
        for init in runs(argvs[name], "init"):
            home, found = home_of(init, at)
            problems += found
            inits[home] = (name, init)
    servers = {n: s for n, s in services.items() if runs(argvs[n], "server")}
    replicas = sum(int((s.get("deploy") or {}).get("replicas", 1)) for s in servers.values())
    if replicas < 2:
        problems.append(Problem(where, f"{replicas} control-plane replica(s); want at least 2"))
    dbs = {}
    for name, svc in servers.items():
        server = runs(argvs[name], "server")[0]
        found, dbs[name] = _check_server(svc, server, services, inits, f"{where}#{name}")
        problems += found
    if len(set(dbs.values())) > 1:
        problems.append(Problem(where, f"replicas use different databases: {dbs}"))
    return problems


def _check_depends_on(service: Mapping, services: Mapping, where: str) -> list[Problem]:
    if not isinstance(service.get("depends_on") or {}, Mapping):
        return [Problem(where, "depends_on without conditions only orders container starts")]
    problems = []
    for dep, spec in _depends_on(service).items():
        condition = (spec or {}).get("condition")
        if dep not in services:
            problems.append(Problem(where, f"depends on unknown service {dep}"))
        elif condition is None:
            problems.append(Problem(where, f"depends on {dep} without a condition"))
        elif condition == "service_healthy" and not services[dep].get("healthcheck"):
            problems.append(Problem(where, f"waits for {dep} to be healthy; it has no healthcheck"))
    return problems


def _check_server(
    svc: Mapping, argv: list[str], services: Mapping, inits: Mapping, at: str
) -> tuple[list[Problem], str | None]:
    """Check one replica; return its problems and the database URL it ends up using."""
    env = _env(svc.get("environment"))
    port, problems = bind_problems(grpc_address(argv, env), at)
    if svc.get("ports") and port not in _container_ports(svc):
        problems.append(Problem(at, f"publishes {sorted(_container_ports(svc))}, serves {port}"))
    if f":{port}" not in " ".join(_healthcheck_argv(svc)):
        problems.append(Problem(at, f"no healthcheck against the gRPC port {port}"))
    home, found = home_of(argv, at)
    problems += found
    if home not in inits:
        return [*problems, Problem(at, f"no init service initialises its home {home}")], None
    init_name, init_argv = inits[home]
    if (_depends_on(svc).get(init_name) or {}).get("condition") != (
        "service_completed_successfully"
    ):
        problems.append(Problem(at, f"does not wait for {init_name} to complete"))
    mine = volume_holding(home, _mounts(svc))
    theirs = volume_holding(home, _mounts(services[init_name]))
    if mine is None or mine != theirs:
        problems.append(Problem(at, f"home {home} is on {mine}, {init_name} wrote it on {theirs}"))
    # Flag > environment > the home's skiff.json, which init wrote from its own flags
    # (never from its environment: that stays out of the file).
    db = parse_skiff_argv(argv).db or env.get("SKIFF_DB") or parse_skiff_argv(init_argv).db
    if not (db or "").startswith("postgresql"):
        problems.append(Problem(at, f"database {db!r} is not PostgreSQL"))
    if not parse_skiff_argv(argv).replica:  # the home is shared: a plain server is refused
        problems.append(Problem(at, "serves a shared home without --replica"))
    return problems, db
