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

from contract import errors
from control_plane.settings import Config

Output = tuple[object, object] | None

# `agent run --once`: synced, but the device does not run its whole desired state (a
# version failed its self-test or its download); the error line says which and why.
EXIT_NOT_CONVERGED = 9
# `skiff infer`: inputs and outputs travel in one local gRPC message each.
MAX_INFER_BYTES = 60 << 20


# The environment `skiff agent run` reads beyond the SKIFF_* settings (SKIFF_CA is one):
# infra/systemd/skiff-agent.env.example lists each.
AGENT_ENV = {
    "SKIFF_AGENT_SERVER": "--server",
    "SKIFF_ENROLL_TOKEN": "--enroll-token",
    "SKIFF_REPORT_INTERVAL_S": "--report-interval",
}


class NotConverged(errors.SkiffError):
    """The device synced but does not run its desired state."""


class UsageError(errors.SkiffError):
    """The command line cannot work as given (exit 2, as argparse's own refusals)."""


def add_parsers(sub, common: Callable[..., None]) -> None:
    """Add `skiff agent` to the `skiff` parser."""
    agent = sub.add_parser("agent", help="the device agent: enroll, sync, install, serve")
    asub = agent.add_subparsers(dest="action", required=True, metavar="ACTION")

    p = asub.add_parser("run", help="run the agent (until SIGTERM, or once with --once)")
    p.set_defaults(home=None, json=False)
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
    p.set_defaults(home=None)
    p.add_argument("--state", type=Path, required=True, metavar="DIR", help="agent state")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("infer", help="run a model through the local agent")
    p.set_defaults(home=None)
    p.add_argument("--state", type=Path, required=True, metavar="DIR", help="agent state")
    p.add_argument("model", metavar="MODEL")
    p.add_argument("--input", type=Path, required=True, metavar="FILE.npz", help="named inputs")
    p.add_argument("-o", "--output", type=Path, metavar="OUT.npz", help="write the outputs here")
    p.add_argument("--timeout", type=_positive_seconds, default=60.0, metavar="S")
    p.add_argument("--json", action="store_true", help="machine-readable output")


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
    from contract.assignment import AssignmentRejected
    from contract.device_client import DeviceCallError
    from device_agent.agent import Refused
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
        if exc.message.startswith("control plane unreachable"):  # says why already
            raise errors.Unavailable(exc.message) from None
        raise errors.Unavailable(f"control plane call failed: {exc.message}") from None


def _app_limits(args: argparse.Namespace):
    """Return the local API's bounds from the flags given (None: the defaults)."""
    from device_agent.limits import AppLimits

    given = {
        "events_per_s": args.push_events_per_s,
        "runs_per_s": args.pipeline_runs_per_s,
        "subscribers": args.max_subscribers,
    }
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return None
    if "runs_per_s" in given:  # a burst of ten seconds' worth, as the default's
        given["runs_burst"] = max(AppLimits.runs_burst, int(given["runs_per_s"] * 10))
    return AppLimits(**given)


def start_agent_run(*, config: Config, args: argparse.Namespace) -> Output:
    """Run the agent until SIGTERM/SIGINT, or sync once with --once."""
    from contract.transport import address_problem
    from control_plane.api.transport import client_tls
    from control_plane.fleet.attributes import parse_attr_flags
    from device_agent.agent import Agent
    from device_agent.state import StateDir

    if not args.server:
        raise UsageError("--server HOST:PORT (or SKIFF_AGENT_SERVER) is required")
    if problem := address_problem(args.server):
        raise errors.InvalidArgument(f"--server (or SKIFF_AGENT_SERVER): {problem}")
    enroll_token = args.enroll_token or os.environ.get("SKIFF_ENROLL_TOKEN", "")
    with _agent_errors():
        enrolled = StateDir(args.state).load_identity() is not None
    if not enrolled and not enroll_token:
        # Nothing to run as and nothing to enroll with: the command line lacks a flag.
        raise UsageError(
            f"{args.state} holds no device identity: pass --enroll-token (or "
            "SKIFF_ENROLL_TOKEN) to enroll"
        )
    _configure_logging(args.json_log)
    attributes = None if args.attr is None else parse_attr_flags(args.attr)
    agent = Agent(
        StateDir(args.state),
        args.server,
        tls=client_tls(config),
        enroll_token=enroll_token,
        attributes=attributes,
        serve=not args.once,
        report_interval_s=args.report_interval,
        app_limits=_app_limits(args),
    )

    async def main() -> object:
        async with agent:
            if args.once:
                outcome = await agent.sync_once()
                with contextlib.suppress(Exception):  # best effort: the next start retries
                    await asyncio.wait_for(agent.flush_reports(), 10)
                return outcome
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
    if body.get("clock"):
        lines.append(f"clock    {body['clock']} (measured {body['clock_measured_at']})")
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


def start_infer(*, config: Config, args: argparse.Namespace) -> Output:
    """Run MODEL on the inputs in an .npz through the agent's local API."""
    import grpc

    from device_agent.local_api import socket_path, to_array, to_tensor
    from device_agent.state import AgentError
    from protos import agent_pb2, agent_pb2_grpc
    from runtime.npz import read_npz, write_npz

    try:
        path = socket_path(args.state)
    except AgentError as exc:
        raise errors.InvalidArgument(str(exc)) from None
    if not path.exists():
        raise errors.Unavailable(f"no agent is serving {args.state} (no socket {path})")
    try:
        inputs = read_npz(args.input.read_bytes(), str(args.input), limit=MAX_INFER_BYTES)
    except ValueError as exc:
        raise errors.InvalidArgument(str(exc)) from None
    request = agent_pb2.InferRequest(
        model=args.model, inputs=[to_tensor(k, v) for k, v in inputs.items()]
    )
    with grpc.insecure_channel(
        f"unix:{path}", options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        try:
            reply = agent_pb2_grpc.AgentServiceStub(channel).Infer(request, timeout=args.timeout)
        except grpc.RpcError as exc:
            raise _infer_error(exc) from None
    outputs = {t.name: to_array(t) for t in reply.outputs}
    if args.output is not None:
        from control_plane.files import write_private_file

        write_private_file(args.output, write_npz(outputs), replace=True)
    body = {
        "model": reply.model,
        "version": reply.version,
        "variant": reply.variant,
        "config": reply.config,
        "latency_us": round(reply.latency_us, 1),
        "outputs": {
            name: {"dtype": a.dtype.name, "shape": list(a.shape)}
            | ({} if args.output is not None else {"values": a.tolist()})
            for name, a in outputs.items()
        },
        "output_file": str(args.output) if args.output is not None else None,
    }
    return body, _infer_text(body, outputs)


def _infer_error(exc) -> errors.SkiffError:
    import grpc

    code, message = exc.code(), exc.details() or exc.code().name.lower()
    kinds = {
        grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
        grpc.StatusCode.NOT_FOUND: errors.NotFound,
        grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
    }
    if code == grpc.StatusCode.UNAVAILABLE and "connect" in message.lower():
        return errors.Unavailable(f"the agent does not answer: {message}")
    return kinds.get(code, errors.Unavailable)(message)


def _infer_text(body: dict, outputs: dict) -> str:
    import numpy as np

    lines = [
        f"{body['model']} v{body['version']} ({body['variant']}) on {body['config'] or '?'}"
        f"  {body['latency_us'] / 1000:.2f} ms"
    ]
    for name, a in outputs.items():
        preview = np.array2string(a.reshape(-1)[:6], precision=4, separator=", ")
        lines.append(f"  {name}  {a.dtype.name}{list(a.shape)}  {preview}")
    if body["output_file"]:
        lines.append(f"outputs written to {body['output_file']}")
    return "\n".join(lines)
