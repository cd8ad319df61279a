"""The `skiff` command: parses arguments and calls keyword-only start_* functions."""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
from pathlib import Path

from contract import errors
from contract.command_line import (  # noqa: F401  (the exit codes are this module's API too)
    EXIT_AUTH,
    EXIT_BROKEN_PIPE,
    EXIT_CONFLICT,
    EXIT_ERROR,
    EXIT_INTEGRITY,
    EXIT_INVALID,
    EXIT_NOT_CONVERGED,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    HelpFormatter,
    SkiffParser,
    add_version_flag,
    run_guarded,
)
from contract.command_line import EXIT_BY_ERROR as _SHARED_EXITS
from contract.extras import DEVICE_COMMANDS, operator_refusal, own_entry_points
from control_plane.cli import fleet_commands, rollout_watch, signing_commands, sim_commands
from control_plane.cli.golden_flags import add_golden_flags, add_push_flags
from control_plane.cli.listing import add_limit_flag
from control_plane.settings import SETTINGS, Setting, default_home, load_config

# `rollout wait` that ran out of time ends as `agent run --once` that did not converge.
EXIT_BY_ERROR = ((rollout_watch.WaitTimedOut, EXIT_NOT_CONVERGED), *_SHARED_EXITS)

# Command groups found through entry points: the device side's `agent` and `infer`
# (device_agent.cli), which control_plane may not import. Each is a callable(sub_parsers,
# common) whose sub-parsers set `start`, the function that runs them (it reads its own
# settings: a device-only install has no control_plane.settings).
COMMAND_GROUP = "skiff.commands"


def _setting_help(s: Setting) -> str:
    """Return the help of a setting's flag: its doc, its variable and its default.

    The flag's own default is None: a flag not given must not hide the environment or
    skiff.json, so the setting's default is said in words.
    """
    default = f"; default: {s.default}" if s.default not in ("", None) else ""
    return f"{s.doc.rstrip('.')} ({s.env}{default})".replace("%", "%%")


def _common(
    parser: argparse.ArgumentParser, *, json_flag: bool = True, remote: bool = True
) -> None:
    parser.add_argument(
        "--home", type=Path, default=None, help=f"state folder (default {default_home()})"
    )
    if remote:  # commands that dial a control plane
        parser.add_argument(
            "--ca", dest="tls_ca", metavar="PEM", help="CA to verify the server (SKIFF_CA)"
        )
    if json_flag:
        parser.add_argument("--json", action="store_true", help="machine-readable output")


def build_parser() -> argparse.ArgumentParser:
    """Return the full argument parser."""
    parser = SkiffParser(prog="skiff", description="Ship MNN models to fleets.")
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("init", help="create the embedded default in the home folder")
    _common(p, remote=False)
    for s in SETTINGS:
        if s.name in ("grpc", "db", "blobs", "kek"):
            p.add_argument(f"--{s.name}", help=_setting_help(s))
    p.add_argument(
        "--tls-san",
        action="append",
        default=[],
        metavar="NAME",
        help="another host name or IP for the generated server certificate (repeatable)",
    )
    p.add_argument("--tls-cert", metavar="PEM", help="your own server certificate instead")
    p.add_argument("--tls-key", metavar="PEM", help="its private key (mode 0600)")
    p.add_argument("--tls-ca", metavar="PEM", help="the CA that signed --tls-cert")

    p = sub.add_parser("server", help="run the control plane")
    _common(p, json_flag=False, remote=False)
    for s in SETTINGS:
        if s.name in ("grpc", "http", "db", "blobs"):
            p.add_argument(f"--{s.name}", help=_setting_help(s))
    p.add_argument(
        "--replica",
        action="store_true",
        help="one of several servers of this home on purpose (PostgreSQL only): they share "
        "the home and may share the --grpc address; without it a second server is refused",
    )
    p.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="server processes sharing the --grpc port (default: one per core with "
        "PostgreSQL; SQLite serves one)",
    )
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)  # set by --workers

    model = sub.add_parser("model", help="push, list, show and pull models")
    msub = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = msub.add_parser(
        "push",
        help="upload a .mnn, .onnx or .gguf file, or an MNN-LLM bundle (a directory or a tar)",
    )
    _common(p)
    p.add_argument("file", type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--notes", default="")
    add_push_flags(p)
    add_golden_flags(p)
    p.add_argument(
        "--pipeline",
        type=Path,
        metavar="FILE.json",
        help="the version's event pipeline (event types, triggers, features; see README)",
    )
    p = msub.add_parser("ls", help="list models")
    _common(p)
    add_limit_flag(p, "models, by name")
    p = msub.add_parser("show", help="show a model's versions, or one version")
    _common(p)
    p.add_argument("ref", metavar="NAME[:VERSION]")
    add_limit_flag(p, "versions, oldest first")
    p.add_argument(
        "--backends",
        action="store_true",
        help="show the version's backend configs per device class, from fleet telemetry "
        "(samples, p50/p95, crash and fallback rates) and which one is recommended",
    )
    p = msub.add_parser("pull", help="download a decrypted model (admin only)")
    _common(p)
    p.add_argument("ref", metavar="NAME:VERSION")
    p.add_argument("--variant", default="")
    p.add_argument(
        "--golden",
        action="store_true",
        help="pull the version's golden data (.npz of inputs and fp32 outputs) instead",
    )
    p.add_argument("-o", "--output", type=Path, required=True)

    key = sub.add_parser("key", help="manage the key-encryption and signing keys")
    ksub = key.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = ksub.add_parser("rotate", help="re-wrap every data key under a new KEK")
    _common(p)
    p.add_argument("--to", default="", help="new KEK URL (aws-kms://...); default: new local key")
    signing_commands.add_parsers(ksub, _common)

    p = sub.add_parser("gc", help="delete blobs no version references, older than the grace period")
    _common(p)
    p.add_argument("--dry-run", action="store_true", help="list what would be deleted, keep it")

    fleet_commands.add_parsers(sub, _common)
    sim_commands.add_parsers(sub, _common)
    for plugin in own_entry_points(COMMAND_GROUP):
        plugin.load()(sub, _common)

    p = sub.add_parser("demo", help="run the end-to-end demo on a throwaway home")
    _common(p, json_flag=False, remote=False)
    p.add_argument(
        "--real-models",
        action="store_true",
        help="also publish and run PP-OCRv4 and Silero VAD from their PyPI packages",
    )
    return parser


def _overrides(args: argparse.Namespace) -> dict:
    return {s.name: getattr(args, s.name, None) for s in SETTINGS}


def _run(args: argparse.Namespace) -> int:
    from control_plane.cli import commands  # deferred: keeps `skiff --help` instant

    if getattr(args, "start", None) is not None:  # a COMMAND_GROUP command reads its own
        result = args.start(args=args)
    else:
        config = load_config(args.home, _overrides(args))
        name = f"start_{args.command}_{getattr(args, 'action', '')}".rstrip("_")
        name = name.replace("-", "_")
        modules = (commands, fleet_commands, sim_commands, signing_commands)
        module = next(m for m in modules if hasattr(m, name))
        result = getattr(module, name)(config=config, args=args)
    if result is not None:
        if getattr(args, "json", False):
            print(json.dumps(result[0], indent=2, sort_keys=True))
        else:
            from control_plane.cli.render import print_output

            print_output(result[1])
    return EXIT_OK


# The server's refusal names the RPC ("token tok_1 (ci) is viewer; CreateRollout needs
# operator"); a CLI user typed a command, so the CLI names that instead.
_ROLE_REFUSAL = re.compile(
    r"token (?P<token>.+) is (?P<role>\w+); (?P<rpc>\w+) needs (?P<needed>\w+)"
)


def command_line(args: argparse.Namespace) -> str:
    """Return the command `args` came from, as typed: `skiff rollout promote`."""
    action = getattr(args, "action", None)
    return " ".join(p for p in ("skiff", args.command, action) if p)


def error_message(exc: errors.SkiffError, args: argparse.Namespace) -> str:
    """Return the one line that reports `exc` (a role refusal names the CLI command)."""
    found = _ROLE_REFUSAL.fullmatch(str(exc)) if isinstance(exc, errors.PermissionDenied) else None
    if found is None:
        return str(exc)
    who = f"token {found['token']} is {found['role']}"
    return f"{who}; `{command_line(args)}` needs {found['needed']}"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the operator's `skiff` (the console script's, and `python -m`'s)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Run as `python -m control_plane.cli` on a device-only install: one line, before a
    # command fails halfway for want of SQLAlchemy (init would have written keys).
    command = argv[0] if argv[:1] and not argv[0].startswith("-") else "--help"
    if command not in DEVICE_COMMANDS and (refusal := operator_refusal(command)):
        print(refusal, file=sys.stderr)
        return EXIT_USAGE
    args = build_parser().parse_args(argv)  # GRPC_VERBOSITY: see control_plane/cli/__init__
    logging.basicConfig(
        level=logging.INFO if args.command in ("server", "demo") else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Alembic says at INFO which of its plugins it set up, on every import: noise.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    return run_guarded(
        lambda: _run(args), table=EXIT_BY_ERROR, message=lambda e: error_message(e, args)
    )


if __name__ == "__main__":
    sys.exit(main())
