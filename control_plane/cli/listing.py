"""The --limit flag of listing commands: by default every item, read page by page."""

from __future__ import annotations

import argparse
import sys

from contract import errors
from control_plane.views import listed  # noqa: F401 - the CLI's commands take it from here


def add_limit_flag(parser: argparse.ArgumentParser, what: str) -> None:
    """Add `--limit N` to a listing command; `what` names the items and their order."""
    parser.add_argument(
        "--limit",
        type=int,
        default=0,
        metavar="N",
        help=f"show the first N {what} (default 0: all of them, read page by page); "
        "when more exist, stderr says so",
    )


def limit_of(args: argparse.Namespace) -> int | None:
    """Return the --limit given (None: no limit)."""
    if args.limit < 0:
        raise errors.InvalidArgument(f"--limit {args.limit} is negative")
    return args.limit or None


def say_more(more: bool, what: str, limit: int | None) -> None:
    """Tell the user the list was cut short; on stderr, so stdout stays parseable."""
    if more:
        print(f"skiff: showing the first {limit} {what}; more exist", file=sys.stderr)
