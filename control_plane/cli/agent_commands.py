"""`skiff agent run` and `skiff agent status`: the device agent from the command line."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

from control_plane import errors
from control_plane.settings import Config

Output = tuple[object, object] | None

# `agent run --once`: synced, but the device does not run its whole desired state (a
# version failed its self-test or its download); the error line says which and why.
EXIT_NOT_CONVERGED = 9


class NotConverged(errors.SkiffError):
    """The device synced but does not run its desired state."""


def add_parsers(sub, common: Callable[..., None]) -> None:
    """Add `skiff agent` to the `skiff` parser."""
    agent = sub.add_parser("agent", help="the device agent: enroll, sync, install, serve")
    asub = agent.add_subparsers(dest="action", required=True, metavar="ACTION")

    p = asub.add_parser("run", help="run the agent (until SIGTERM, or once with --once)")
    p.set_defaults(home=None, json=False)
    p.add_argument("--server", required=True, metavar="HOST:PORT", help="control plane")
    p.add_argument("--state", type=Path, required=True, metavar="DIR", help="agent state")
    p.add_argument(
        "--enroll-token",
        default=os.environ.get("SKIFF_ENROLL_TOKEN", ""),
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

    p = asub.add_parser("status", help="show the agent's identity and installed models")
    p.set_defaults(home=None)
    p.add_argument("--state", type=Path, required=True, metavar="DIR", help="agent state")
    p.add_argument("--json", action="store_true", help="machine-readable output")


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return json.dumps(
            {
                "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
                "level": record.levelname.lower(),
                "logger": record.name,
                "message": record.getMessage(),
            },
            sort_keys=True,
        )


def _configure_logging(json_lines: bool) -> None:
    root = logging.getLogger()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        _JsonLines()
        if json_lines
        else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root.handlers[:] = [handler]
    logging.getLogger("skiff.agent").setLevel(logging.INFO)


@contextlib.contextmanager
def _agent_errors() -> Iterator[None]:
    """Turn the agent's failures into the CLI's errors (one line, one exit code)."""
    from device_agent.agent import Refused
    from device_agent.assignment import AssignmentRejected
    from device_agent.connection import DeviceCallError
    from device_agent.install import IntegrityFailure
    from device_agent.state import AgentError, StateLocked

    try:
        yield
    except Refused as exc:
        raise errors.PermissionDenied(str(exc)) from None
    except StateLocked as exc:
        raise errors.FailedPrecondition(str(exc)) from None
    except (AssignmentRejected, IntegrityFailure) as exc:
        raise errors.IntegrityError(str(exc)) from None
    except AgentError as exc:
        raise errors.FailedPrecondition(str(exc)) from None
    except DeviceCallError as exc:
        raise errors.Unavailable(f"control plane call failed: {exc.message}") from None


def start_agent_run(*, config: Config, args: argparse.Namespace) -> Output:
    """Run the agent until SIGTERM/SIGINT, or sync once with --once."""
    from control_plane.api.transport import client_tls
    from control_plane.fleet.attributes import parse_attr_flags
    from device_agent.agent import Agent
    from device_agent.state import StateDir

    _configure_logging(args.json_log)
    attributes = None if args.attr is None else parse_attr_flags(args.attr)
    agent = Agent(
        StateDir(args.state),
        args.server,
        tls=client_tls(config),
        enroll_token=args.enroll_token,
        attributes=attributes,
    )

    async def main() -> object:
        async with agent:
            if args.once:
                return await agent.sync_once()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await agent.run(stop)
            logging.getLogger("skiff.agent").info("stopped")
            return None

    with _agent_errors():
        outcome = asyncio.run(main())
    if args.once:
        failed = [f"{o.model} v{o.version}: {o.reason}" for o in outcome.installs if o.reason]
        if not outcome.converged:
            raise NotConverged(
                "the device does not run its desired state: " + ("; ".join(failed) or "?")
            )
    return None


def start_agent_status(*, config: Config, args: argparse.Namespace) -> Output:
    """Show who the device is and what it runs, from the state directory alone."""
    from device_agent.status import read_status

    with _agent_errors():
        body = read_status(args.state)
    return body, _status_text(body)


def _status_text(body: dict) -> str:
    lines = [
        f"device   {body['device_id'] or '(not enrolled)'}",
        f"server   {body['server']}",
        f"agent    {'running (pid ' + str(body['pid']) + ')' if body['running'] else 'stopped'}",
        f"revision {body['revision']}   last sync {body['last_sync'] or 'never'}",
    ]
    if body["last_error"]:
        lines.append(f"error    {body['last_error']} ({body['last_error_at']})")
    for name, m in sorted(body["models"].items()):
        active = m["active"]
        lines.append(
            f"model    {name}: "
            + (
                f"v{active['version']} ({active['variant']}) on {active['config'] or '?'}"
                if active
                else "nothing active"
            )
            + (f", previous v{m['previous']['version']}" if m["previous"] else "")
        )
        if m["failed"]:
            lines.append(f"         v{m['failed']['version']} failed: {m['failed']['reason']}")
    return "\n".join(lines)
