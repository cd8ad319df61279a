"""The `skiff` console script: the device side's commands, and the way to the operator's.

Every install has the device side, so `skiff` starts here. `skiff agent ...` and
`skiff infer` are parsed and run by this module; any other command belongs to the
operator's command line (control_plane.cli), found through the "skiff.cli" entry point
rather than imported: a device-only install (`pip install skiff`, no `[server]`) lacks
its dependencies, and the device side never imports the control plane. There, an
operator command gets one line naming the extra to install, not a traceback.

The operator's `skiff --help` lists `agent` and `infer` too: it adds them through the
"skiff.commands" entry point, which is `add_parsers` below.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from contract.command_line import (
    EXIT_OK,
    EXIT_USAGE,
    SkiffParser,
    add_version_flag,
    run_guarded,
)
from contract.extras import (
    DEVICE_COMMANDS,
    DISTRIBUTION,
    SERVER_EXTRA,
    operator_refusal,
    own_entry_points,
)

# The operator's command line (control_plane.cli) and its commands: a typo of a device
# command is not told to install the server (tests check the list against its parser).
OPERATOR_GROUP, OPERATOR = "skiff.cli", "operator"
OPERATOR_COMMANDS = frozenset(
    {"init", "server", "model", "key", "gc", "token", "fleet", "rollout", "sim", "demo"}
)

# The environment `skiff agent run` reads beyond the SKIFF_* settings (SKIFF_CA is one):
# infra/systemd/skiff-agent.env.example lists each.
AGENT_ENV = {
    "SKIFF_AGENT_SERVER": "--server",
    "SKIFF_ENROLL_TOKEN": "--enroll-token",
    "SKIFF_REPORT_INTERVAL_S": "--report-interval",
}


def add_parsers(sub, common: Callable[..., None] | None = None) -> None:
    """Add `skiff agent` and `skiff infer` to a `skiff` parser's sub-parsers.

    The "skiff.commands" entry point: the operator's parser calls it with its own
    option helper (`common`), which these commands do not use (they dial no operator
    home). Each sub-parser names its `start_*` function in `args.start`.
    """
    from device_agent import commands

    agent = sub.add_parser("agent", help="the device agent: enroll, sync, install, serve")
    asub = agent.add_subparsers(dest="action", required=True, metavar="ACTION")

    p = asub.add_parser("run", help="run the agent (until SIGTERM, or once with --once)")
    p.set_defaults(home=None, json=False, start=commands.start_agent_run)
    p.add_argument(
        "--server",
        default=os.environ.get("SKIFF_AGENT_SERVER", ""),
        metavar="HOST:PORT",
        help="control plane (SKIFF_AGENT_SERVER); required",
    )
    p.add_argument("--state", type=Path, required=True, metavar="DIR", help="agent state")
    p.add_argument(
        "--enroll-token",
        default="",  # read from SKIFF_ENROLL_TOKEN at run time: --help must not print it
        metavar="T",
        help="enroll with this token (SKIFF_ENROLL_TOKEN keeps it out of the process list); "
        "only the first start needs it",
    )
    p.add_argument(
        "--attr",
        action="append",
        default=None,
        metavar="KEY=VALUE",
        help="a device attribute to report (repeatable; replaces the stored ones)",
    )
    p.add_argument("--once", action="store_true", help="sync and install once, then exit")
    p.add_argument("--json-log", action="store_true", help="log JSON lines to stderr")
    p.add_argument("--ca", dest="tls_ca", metavar="PEM", help="CA to verify the server")
    p.add_argument(
        "--report-interval",
        type=_positive_seconds,
        default=float(os.environ.get("SKIFF_REPORT_INTERVAL_S", "60")),
        metavar="S",
        help="seconds between telemetry reports (SKIFF_REPORT_INTERVAL_S; default 60)",
    )
    p.add_argument(
        "--push-events-per-s",
        type=_positive_rate,
        default=None,
        metavar="N",
        help="events a second apps may push to one model (default 10,000; bursts of one full push)",
    )
    p.add_argument(
        "--pipeline-runs-per-s",
        type=_positive_rate,
        default=None,
        metavar="N",
        help="model runs a second a model's pipeline firings may cost (default 500)",
    )
    p.add_argument(
        "--max-subscribers",
        type=_positive_int,
        default=None,
        metavar="N",
        help="Subscribe streams open at once per model (default 16)",
    )

    p = asub.add_parser("status", help="show the agent's identity and installed models")
    p.set_defaults(home=None, start=commands.start_agent_status)
    p.add_argument("--state", type=Path, required=True, metavar="DIR", help="agent state")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("infer", help="run a model through the local agent")
    p.set_defaults(home=None, start=commands.start_infer)
    p.add_argument("--state", type=Path, required=True, metavar="DIR", help="agent state")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--input", type=Path, required=True, metavar="FILE.npz", help="named inputs")
    p.add_argument("-o", "--output", type=Path, metavar="OUT.npz", help="write the outputs here")
    p.add_argument("--timeout", type=_positive_seconds, default=60.0, metavar="S")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser(
        "generate",
        help="generate text with a language model through the local agent, streamed",
    )
    p.set_defaults(home=None, start=commands.start_generate)
    p.add_argument("--state", type=Path, required=True, metavar="DIR", help="agent state")
    p.add_argument("model", metavar="MODEL")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", metavar="TEXT", help="a raw prompt, completed as it is")
    source.add_argument(
        "--messages",
        type=Path,
        metavar="FILE.json",
        help='chat messages: a JSON list of {"role": "system"|"user"|"assistant", '
        '"content": TEXT}, rendered with the model\'s chat template',
    )
    p.add_argument("--max-tokens", type=_positive_int, default=256, metavar="N")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-k", type=_top_k, default=0, metavar="K", help="0: no cut")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P")
    p.add_argument("--seed", type=_seed, metavar="N", help="for reproducible sampling")
    p.add_argument(
        "--stop", action="append", default=[], metavar="TEXT", help="stop before it (repeatable)"
    )
    p.add_argument("--timeout", type=_positive_seconds, default=600.0, metavar="S")
    p.add_argument(
        "--json", action="store_true", help="print one document at the end: text and summary"
    )


def _top_k(text: str) -> int:
    if not (text.isascii() and text.isdecimal()) or int(text) > 1 << 20:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to {1 << 20}")
    return int(text)


def _seed(text: str) -> int:
    if not (text.isascii() and text.isdecimal()) or int(text) >= 1 << 64:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 0 to 2**64-1")
    return int(text)


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds in (0, 86400]")
    return value


def _positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value <= 1e9:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rate in (0, 1e9] a second")
    return value


def _positive_int(text: str) -> int:
    if not (text.isascii() and text.isdecimal()) or not 1 <= int(text) <= 100_000:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number from 1 to 100000")
    return int(text)


def build_parser(*, epilog: str | None = None) -> argparse.ArgumentParser:
    """Return the device side's own parser: `skiff agent ...` and `skiff infer`."""
    parser = SkiffParser(prog="skiff", description="Run the Skiff device agent.", epilog=epilog)
    add_version_flag(parser)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parsers(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `skiff` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] and argv[0] in DEVICE_COMMANDS:
        return run_device_command(argv)
    command = argv[0] if argv[:1] and not argv[0].startswith("-") else None
    refusal = operator_refusal(command or "--help")
    if refusal is None and (operator := _operator_main()) is not None:
        return operator(argv)
    if refusal is not None and command in OPERATOR_COMMANDS:
        print(refusal, file=sys.stderr)
        return EXIT_USAGE
    # `skiff`, `skiff --help`, a typo: the device side's help, saying where the rest is.
    epilog = (
        "Operator commands (model, rollout, fleet, server, ...) need the server side: "
        f"pip install '{DISTRIBUTION}[{SERVER_EXTRA}]'"
    )
    build_parser(epilog=epilog).parse_args(argv)
    return EXIT_USAGE  # not reached: parse_args exits on these


def run_device_command(argv: list[str]) -> int:
    """Parse and run `skiff agent ...` or `skiff infer ...`; return the exit code."""
    # gRPC's C core reads GRPC_VERBOSITY once, when grpc is first imported: keep its own
    # log lines (a failed TLS handshake) out of a command that reports in one line.
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return run_guarded(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    result = args.start(args=args)
    if result is not None:
        body, text = result
        print(json.dumps(body, indent=2, sort_keys=True) if args.json else text)
    return EXIT_OK


def _operator_main() -> Callable[[list[str]], int] | None:
    """Return the operator's `main` (skiff's own "skiff.cli" entry point), if installed."""
    found = own_entry_points(OPERATOR_GROUP, OPERATOR)
    return found[0].load() if found else None


if __name__ == "__main__":
    sys.exit(main())
