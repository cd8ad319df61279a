"""What `skiff agent run`, `skiff agent status` and `skiff infer` do, once parsed.

Each `start_*` function takes the parsed arguments and returns what to print (a JSON
body and its text) or None; failures are SkiffErrors, which contract.cli_exit turns
into one line and an exit code. Everything heavy (the agent, numpy, gRPC) is imported
inside the function that needs it, so `skiff --help` stays instant.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator

from contract import errors
from contract.command_line import NotConverged, UsageError
from contract.key_files import write_private_file

Output = tuple[object, object] | None

# `skiff infer`: inputs and outputs travel in one local gRPC message each.
MAX_INFER_BYTES = 60 << 20


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
    from device_agent.local_quotas import AppLimits

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


def start_agent_run(*, args: argparse.Namespace) -> Output:
    """Run the agent until SIGTERM/SIGINT, or sync once with --once."""
    from contract.attribute_rules import parse_attr_flags
    from contract.transport import address_problem
    from device_agent.agent import Agent
    from device_agent.client_settings import client_tls
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
        tls=client_tls(ca_flag=args.tls_ca),
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


def start_agent_status(*, args: argparse.Namespace) -> Output:
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


def start_infer(*, args: argparse.Namespace) -> Output:
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
