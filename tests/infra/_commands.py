"""Checks shared by every deployment file: SKIFF_* names and values, `skiff` command lines.

Each check returns a list of Problems (empty when all is well), so one run reports
everything that is wrong, and the tests can feed in broken snippets to see them caught.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePosixPath

from control_plane.cli.main import build_parser
from control_plane.settings import SETTINGS
from device_agent.cli import AGENT_ENV

SETTINGS_BY_ENV = {s.env: s for s in SETTINGS}
# Built once: parse_args leaves the parser as it found it.
_parser = functools.cache(build_parser)
SETTINGS_BY_NAME = {s.name: s for s in SETTINGS}
_SKIFF_NAME = re.compile(r"\bSKIFF_[A-Z0-9_]+\b")
_SHELLS = frozenset({"sh", "bash", "dash", "ash"})
# Words that may precede the program of a simple command (with VAR=value assignments).
_PREFIX_WORDS = frozenset(
    {"exec", "env", "then", "do", "else", "if", "while", "until", "!", "time"}
)
_OPERATORS = frozenset({"&&", "||", ";", "|", "&", ";;", "(", ")"})


@dataclass(frozen=True)
class Problem:
    """One thing wrong in a deployment file."""

    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.where}: {self.message}"


def check_env_names(text: str, where: str) -> list[Problem]:
    """Report every SKIFF_* name in `text` that is neither a Setting's nor the agent's."""
    problems = []
    for number, line in enumerate(text.splitlines(), 1):
        for name in _SKIFF_NAME.findall(line):
            if name not in SETTINGS_BY_ENV and name not in AGENT_ENV:
                problems.append(Problem(f"{where}:{number}", f"{name} is not a Skiff setting"))
    return problems


def check_env_values(env: Mapping[str, object], where: str) -> list[Problem]:
    """Report SKIFF_* variables that are unknown or whose value their Setting rejects."""
    problems = []
    for name, value in env.items():
        if not name.startswith("SKIFF_"):
            continue
        setting = SETTINGS_BY_ENV.get(name)
        if setting is None:
            problems.append(Problem(where, f"{name} is not a Skiff setting"))
        elif value not in (None, ""):
            try:
                setting.type(str(value))
            except ValueError:
                problems.append(
                    Problem(where, f"{name}={value!r} is not a {setting.type.__name__}")
                )
    return problems


def skiff_argvs(argv: Sequence[str]) -> list[list[str]]:
    """Return the argument lists of every `skiff` run by one process argv (sh -c included)."""
    argv = _program(argv)
    if not argv:
        return []
    program = PurePosixPath(argv[0]).name
    if program in _SHELLS and "-c" in argv[1:-1]:
        return skiff_argvs_in_script(argv[argv.index("-c") + 1])
    if program == "skiff":
        return [list(argv[1:])]
    if program.startswith("python") and list(argv[1:3]) == ["-m", "control_plane.cli"]:
        return [list(argv[3:])]
    return []


def skiff_argvs_in_script(script: str) -> list[list[str]]:
    """Return the argument lists of every `skiff` that a shell script runs."""
    script = script.replace("\\\n", " ").replace("\n", " ; ")
    lexer = shlex.shlex(script, posix=True, punctuation_chars=";&|()")
    lexer.whitespace_split = True
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token in _OPERATORS:
            segments.append([])
        else:
            segments[-1].append(token)
    return [found for segment in segments for found in skiff_argvs(_unwrap(segment))]


def _program(argv: Sequence[str]) -> list[str]:
    """Drop what precedes the program: shell keywords and VAR=value assignments."""
    argv = list(argv)
    while argv and (
        argv[0] in _PREFIX_WORDS or re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0])
    ):
        argv = argv[1:]
    return argv


def _unwrap(segment: list[str]) -> list[str]:
    """Look through `sudo -u USER`, `kubectl exec ... --` and `docker compose exec SERVICE`."""
    words = _program(segment)
    if words[:1] == ["sudo"]:
        words = words[1:]
        while words and words[0].startswith("-"):
            words = words[2:] if words[0] in ("-u", "-g") else words[1:]
    if words[:1] == ["kubectl"] and "--" in words:
        return words[words.index("--") + 1 :]
    if words[:2] == ["docker", "compose"] and ("exec" in words or "run" in words):
        rest = words[words.index("exec" if "exec" in words else "run") + 1 :]
        while rest and rest[0].startswith("-"):
            rest = rest[2:] if rest[0] in ("-e", "--env", "-u", "--user", "-w") else rest[1:]
        return rest[1:]  # past the service name
    return words


def check_skiff_argv(argv: Sequence[str], where: str) -> list[Problem]:
    """Report a `skiff` argument list that does not parse, or that abbreviates a flag."""
    shown = shlex.join(["skiff", *argv])
    parser = _parser()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            parser.parse_args(list(argv))
    except SystemExit as exc:
        if exc.code not in (0, None):  # 0: --help
            reason = err.getvalue().strip().splitlines()[-1:] or ["exit " + str(exc.code)]
            return [Problem(where, f"`{shown}` does not parse: {reason[0]}")]
    # argparse also takes unambiguous prefixes (--gr for --grpc), which break as soon as
    # another flag shares the prefix: every flag must be spelled out.
    known = set().union(*(p._option_string_actions for p in _parser_chain(parser, argv)))
    problems = []
    for word in _flags(argv):
        if word not in known:
            problems.append(Problem(where, f"`{shown}`: {word} is not a flag of this command"))
    return problems


def parse_skiff_argv(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a `skiff` argument list that check_skiff_argv accepted."""
    return _parser().parse_args(list(argv))


def _flags(argv: Iterable[str]) -> list[str]:
    flags = []
    for word in argv:
        if word == "--":
            break
        if word.startswith("--"):
            flags.append(word.split("=", 1)[0])
    return flags


def _parser_chain(parser: argparse.ArgumentParser, argv: Sequence[str]):
    """Yield the parser and each sub-command parser `argv` selects."""
    rest = list(argv)
    while True:
        yield parser
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        words = [w for w in rest if not w.startswith("-")]
        if not subs or not words or words[0] not in subs[0].choices:
            return
        parser = subs[0].choices[words[0]]
        rest = rest[rest.index(words[0]) + 1 :]


def check_commands(argvs: Iterable[Sequence[str]], where: str) -> list[Problem]:
    """Check every `skiff` command line the given process argvs run."""
    return [
        p for argv in argvs for found in skiff_argvs(argv) for p in check_skiff_argv(found, where)
    ]


def grpc_address(skiff_argv: Sequence[str], env: Mapping[str, str]) -> str:
    """Return the address `skiff server` binds: --grpc, else SKIFF_GRPC, else the default."""
    args = parse_skiff_argv(skiff_argv)
    return (
        getattr(args, "grpc", None)
        or env.get(SETTINGS_BY_NAME["grpc"].env)
        or SETTINGS_BY_NAME["grpc"].default
    )


def bind_problems(address: str, where: str) -> tuple[int | None, list[Problem]]:
    """Return the port of a HOST:PORT bind address, and what is wrong with it in a container.

    A loopback bind inside a container or pod is unreachable from its Service, its
    neighbours and the kubelet's probes.
    """
    host, _, port = address.rpartition(":")
    if not port.isdigit():
        return None, [Problem(where, f"gRPC address {address!r} has no numeric port")]
    if host in ("127.0.0.1", "localhost", "[::1]"):
        return int(port), [Problem(where, f"gRPC binds {address}: unreachable from outside")]
    return int(port), []


def runs(argv: Sequence[str], command: str) -> list[list[str]]:
    """Return the `skiff <command> ...` argument lists `argv` runs that parse.

    One that does not parse is reported by check_commands; nothing more is read from it.
    """
    return [a for a in skiff_argvs(argv) if a[:1] == [command] and not check_skiff_argv(a, "")]


def home_of(skiff_argv: Sequence[str], where: str) -> tuple[str | None, list[Problem]]:
    """Return the --home of a parsed `skiff` argument list; without one, a Problem."""
    home = parse_skiff_argv(skiff_argv).home
    if home is None:  # ~/.skiff of whoever runs it: replicas and init would not share it
        return None, [Problem(where, f"`skiff {skiff_argv[0]}` needs an explicit --home")]
    return PurePosixPath(home).as_posix(), []


def volume_holding(path: str, mounts: Iterable[tuple[str | None, str]]) -> str | None:
    """Return the volume holding `path`, given (volume, mount path) pairs: the deepest one."""
    above = [
        (target, volume) for volume, target in mounts if PurePosixPath(path).is_relative_to(target)
    ]
    return max(above, key=lambda tv: len(tv[0]))[1] if above else None
