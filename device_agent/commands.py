"""What `skiff agent run`, `skiff agent status`, `skiff infer` and `skiff generate` do.

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


# `skiff generate --messages`: a chat, not a document.
MAX_MESSAGES_BYTES = 1 << 20


def start_generate(*, args: argparse.Namespace) -> Output:
    """Stream MODEL's answer to a prompt or chat through the agent's local API.

    The text goes to stdout as it comes and the summary to stderr; with --json, one
    document at the end. Ctrl-C stops the generation on the device too.
    """
    import grpc

    from protos import agent_pb2, agent_pb2_grpc

    path = _agent_socket(args.state)
    request = agent_pb2.GenerateRequest(
        model=args.model,
        prompt=args.prompt or "",
        max_new_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop=args.stop,
    )
    if args.seed is not None:
        request.seed = args.seed
    if args.messages is not None:
        request.messages.extend(
            agent_pb2.ChatMessage(role=m["role"], content=m["content"])
            for m in _read_messages(args.messages)
        )
    text, summary = [], None
    with grpc.insecure_channel(f"unix:{path}") as channel:
        stream = agent_pb2_grpc.AgentServiceStub(channel).Generate(request, timeout=args.timeout)
        try:
            for reply in stream:
                text.append(reply.text)
                if not args.json and reply.text:
                    sys.stdout.write(reply.text)
                    sys.stdout.flush()
                if reply.HasField("summary"):
                    summary = reply.summary
        except grpc.RpcError as exc:
            if not args.json and text:
                print(file=sys.stdout, flush=True)  # end the partial line
            raise _infer_error(exc) from None
        except KeyboardInterrupt:
            stream.cancel()  # the agent stops generating within a token or two
            raise
    body = {"model": args.model, "text": "".join(text), "summary": _summary_json(summary)}
    if args.json:
        return body, None
    print(flush=True)
    print(_summary_text(args.model, body["summary"]), file=sys.stderr)
    return None


def _agent_socket(state: os.PathLike) -> os.PathLike:
    from device_agent.local_api import socket_path
    from device_agent.state import AgentError

    try:
        path = socket_path(state)
    except AgentError as exc:
        raise errors.InvalidArgument(str(exc)) from None
    if not path.exists():
        raise errors.Unavailable(f"no agent is serving {state} (no socket {path})")
    return path


def _read_messages(path) -> list[dict]:
    """Read --messages: a JSON list of {"role", "content"} objects (the agent checks roles)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MESSAGES_BYTES + 1)
    except OSError as exc:
        raise errors.InvalidArgument(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_MESSAGES_BYTES:
        raise errors.InvalidArgument(f"{path}: over {MAX_MESSAGES_BYTES >> 20} MiB of messages")
    try:
        messages = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise errors.InvalidArgument(f"{path} is not JSON: {exc}") from None
    except RecursionError:
        raise errors.InvalidArgument(f"{path}: JSON nested too deep for messages") from None
    if not isinstance(messages, list) or not messages:
        raise errors.InvalidArgument(f"{path}: a non-empty JSON list of messages is expected")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or set(m) != {"role", "content"}
            or not all(isinstance(v, str) for v in m.values())
        ):
            raise errors.InvalidArgument(
                f'{path}: message {i} must be {{"role": TEXT, "content": TEXT}}'
            )
    return messages


def _summary_json(summary) -> dict | None:
    if summary is None:
        return None
    return {
        "version": summary.version,
        "variant": summary.variant,
        "config": summary.config,
        "tokens_in": summary.tokens_in,
        "tokens_out": summary.tokens_out,
        "ttft_ms": round(summary.ttft_ms, 2),
        "prefill_tokens_per_s": round(summary.prefill_tokens_per_s, 1),
        "decode_tokens_per_s": round(summary.decode_tokens_per_s, 1),
        "stop_reason": summary.stop_reason,
    }


def _summary_text(model: str, s: dict | None) -> str:
    if s is None:
        return f"{model}: the agent ended the stream without a summary"
    return (
        f"{model} v{s['version']} ({s['variant']}) on {s['config']}: "
        f"{s['tokens_in']} tokens in, {s['tokens_out']} out ({s['stop_reason']}); "
        f"first token {s['ttft_ms']:.0f} ms, {s['decode_tokens_per_s']:.1f} tokens/s"
    )


def _infer_error(exc) -> errors.SkiffError:
    import grpc

    code, message = exc.code(), exc.details() or exc.code().name.lower()
    kinds = {
        grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
        grpc.StatusCode.NOT_FOUND: errors.NotFound,
        grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
        grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
        grpc.StatusCode.RESOURCE_EXHAUSTED: errors.Busy,
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
