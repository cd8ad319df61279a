"""What both `skiff` command lines share: exit codes, one-line errors and help format.

`skiff agent ...` and `skiff infer` are the device side's own command line
(`device_agent.cli`); every other command is the operator's (`control_plane.cli`), which
a device-only install lacks. A script or a person that runs either sees the same exit
codes, the same one-line errors and the same help, so those live here, once.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import sys
from collections.abc import Callable, Sequence

from contract import errors

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
# `agent run --once`: synced, but the device does not run its whole desired state (a
# version failed its self-test or its download); `rollout wait`: not there in time.
EXIT_NOT_CONVERGED = 9
EXIT_BROKEN_PIPE = 141  # as a shell reports a command SIGPIPE ended: `skiff ... | head`
EXIT_INTERRUPTED = 130


class NotConverged(errors.SkiffError):
    """The device synced but does not run its desired state."""


class UsageError(errors.SkiffError):
    """The command line cannot work as given (exit 2, as argparse's own refusals)."""


ErrorTable = Sequence[tuple[type[errors.SkiffError], int]]

EXIT_BY_ERROR: ErrorTable = (
    (NotConverged, EXIT_NOT_CONVERGED),
    (UsageError, EXIT_USAGE),
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


def run_guarded(
    run: Callable[[], int],
    *,
    table: ErrorTable = EXIT_BY_ERROR,
    message: Callable[[errors.SkiffError], str] = str,
) -> int:
    """Return `run()`'s exit code, or report what it raised in one line and its code.

    The first entry of `table` the error is an instance of gives the code (EXIT_ERROR
    when none is); `message` words a SkiffError (the operator's names the CLI command
    in a role refusal).
    """
    try:
        return run()
    except errors.SkiffError as exc:
        code = next((c for kind, c in table if isinstance(exc, kind)), EXIT_ERROR)
        print(f"skiff: error: {message(exc)}", file=sys.stderr)
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
        return EXIT_INTERRUPTED


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


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """Give a top-level parser `--version`: the installed skiff's version and which parts.

    Read only when asked (metadata and `packaging` cost ~50 ms, every command would pay).
    """
    parser.add_argument(
        "--version", action=_VersionAction, help="print the version and the installed sides"
    )


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(version_line())
        parser.exit()


def version_line() -> str:
    """Return `skiff X.Y.Z (device side)` or `(device and server sides)`, from metadata."""
    from importlib.metadata import PackageNotFoundError, version

    from contract.extras import DISTRIBUTION, SERVER_EXTRA, missing_requirements

    try:
        number = version(DISTRIBUTION)
        sides = "device side" if missing_requirements(SERVER_EXTRA) else "device and server sides"
    except PackageNotFoundError:
        return f"{DISTRIBUTION} (not installed: run from a checkout)"
    return f"{DISTRIBUTION} {number} ({sides})"
