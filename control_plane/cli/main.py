"""The `skiff` command: parses arguments and calls keyword-only start_* functions."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import re
import sys
from pathlib import Path

from contract import errors
from control_plane.cli import (
    agent_commands,
    fleet_commands,
    rollout_watch,
    signing_commands,
    sim_commands,
)
from control_plane.cli.golden_flags import add_golden_flags, add_push_flags
from control_plane.cli.listing import add_limit_flag
from control_plane.settings import SETTINGS, Setting, default_home, load_config

# Exit codes, one per kind of failure, so scripts can tell them apart.
EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2  # argparse's own
EXIT_INVALID = 3
EXIT_NOT_FOUND = 4
EXIT_AUTH = 5
EXIT_UNAVAILABLE = 6
EXIT_CONFLICT = 7
EXIT_INTEGRITY = 8
EXIT_NOT_CONVERGED = agent_commands.EXIT_NOT_CONVERGED  # 9: `agent run --once`, `rollout wait`
EXIT_BROKEN_PIPE = 141  # as a shell reports a command SIGPIPE ended: `skiff ... | head`

EXIT_BY_ERROR: tuple[tuple[type[errors.SkiffError], int], ...] = (
    (agent_commands.NotConverged, EXIT_NOT_CONVERGED),
    (agent_commands.UsageError, EXIT_USAGE),
    (rollout_watch.WaitTimedOut, EXIT_NOT_CONVERGED),
    (errors.InvalidArgument, EXIT_INVALID),
    (errors.TooLarge, EXIT_INVALID),
    (errors.NotFound, EXIT_NOT_FOUND),
    (errors.Unauthenticated, EXIT_AUTH),
    (errors.PermissionDenied, EXIT_AUTH),
    (errors.Unavailable, EXIT_UNAVAILABLE),
    (errors.AlreadyExists, EXIT_CONFLICT),
    (errors.IntegrityError, EXIT_INTEGRITY),
    (errors.FailedPrecondition, EXIT_CONFLICT),
    (errors.OutOfRange, EXIT_INVALID),
)


# Options whose default --help must not print, whatever filled it in.
_SECRET = re.compile(r"token|secret|password|passphrase", re.IGNORECASE)


def _shown_default(action: argparse.Action) -> str | None:
    """Return an option's default as `--help` shows it, or None when it has no real one.

    None, "", [] and a flag's False are "not given", not defaults worth a word. A secret's
    default (a token read from the environment, say) is never shown.
    """
    default = action.default
    if not action.option_strings or default is None or default is argparse.SUPPRESS:
        return None
    if _SECRET.search(action.dest):
        return None
    if isinstance(default, bool) or default in ("", [], ()):
        return None
    return str(default)


class HelpFormatter(argparse.HelpFormatter):
    """Help that ends each option with "(default: X)" where it has a real default.

    One class for every parser (sub-parsers inherit it, see SkiffParser), so no parser
    spells its defaults by hand; help that already says its default is left alone.
    """

    def _format_action(self, action: argparse.Action) -> str:
        shown = _shown_default(action)
        if not action.help and shown is not None:
            action = copy.copy(action)  # argparse prints an option without help bare
            action.help = f"(default: {shown.replace('%', '%%')})"
        return super()._format_action(action)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = (action.help or "").strip()
        shown = _shown_default(action)
        if shown is None or "default" in text.lower():
            return text
        # argparse expands %-formats in help: a default holding "%" must stay literal.
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()


class SkiffParser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; its sub-parsers are SkiffParsers too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


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

    model = sub.add_parser("model", help="push, list, show and pull models")
    msub = model.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = msub.add_parser("push", help="upload a .mnn or .onnx file as a new version")
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
    agent_commands.add_parsers(sub, _common)

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

    config = load_config(args.home, _overrides(args))
    name = f"start_{args.command}_{getattr(args, 'action', '')}".rstrip("_").replace("-", "_")
    modules = (commands, fleet_commands, sim_commands, signing_commands, agent_commands)
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
    """Entry point of the `skiff` console script."""
    args = build_parser().parse_args(argv)  # GRPC_VERBOSITY: see control_plane/cli/__init__
    logging.basicConfig(
        level=logging.INFO if args.command in ("server", "demo") else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    # Alembic says at INFO which of its plugins it set up, on every import: noise.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    try:
        return _run(args)
    except errors.SkiffError as exc:
        code = next((c for kind, c in EXIT_BY_ERROR if isinstance(exc, kind)), EXIT_ERROR)
        print(f"skiff: error: {error_message(exc, args)}", file=sys.stderr)
        return code
    except BrokenPipeError:
        # The reader went away (`skiff fleet ls | head`): end as quietly as `ls | head`
        # does, and keep Python from complaining when it flushes stdout at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        print(
            f"skiff: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "),
            file=sys.stderr,
        )
        return EXIT_ERROR
    except KeyboardInterrupt as exc:
        if exc.args:  # what an interrupted command left behind (client.PushCancelled)
            print(f"skiff: {exc}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
