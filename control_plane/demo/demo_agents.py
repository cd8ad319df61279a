"""Real device agents for `skiff demo`: `skiff agent run` processes, and their local API.

`DemoAgents` starts one agent process per entry (each with its own state directory and
attributes) and stops every one of them when its `with` block ends, however it ends:
SIGTERM (the agent drains and exits), then SIGKILL after a grace period. The agents run
in their own session, so a Ctrl-C in the terminal reaches the demo only and the demo
stops them in order; and, where util-linux's `setpriv` is installed, each is told by
the kernel to stop if the demo itself dies (`--pdeathsig`, set before the agent's
program starts: no Python code runs between fork and exec, which a process holding
gRPC threads must not do).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from contract import errors
from contract.local_api import MAX_SOCKET_PATH, SOCKET_NAME, socket_path
from protos import agent_pb2, agent_pb2_grpc

STOP_GRACE_S = 20.0


@dataclass
class DemoAgent:
    """One agent process and how to reach it."""

    name: str
    attributes: dict[str, str]
    state: Path
    log: Path
    proc: subprocess.Popen | None = None

    def stub(self) -> agent_pb2_grpc.AgentServiceStub:
        """Return a stub for the agent's local API (a new channel each time)."""
        channel = grpc.insecure_channel(f"unix:{socket_path(self.state)}")
        return agent_pb2_grpc.AgentServiceStub(channel)

    def status(self) -> agent_pb2.StatusResponse | None:
        """Return the agent's Status, or None while it is not up yet."""
        try:
            return self.stub().Status(agent_pb2.StatusRequest(), timeout=5)
        except grpc.RpcError:
            return None

    def serving(self, model: str) -> int:
        """Return the version of `model` this agent serves now (0: none)."""
        status = self.status()
        for m in status.models if status is not None else ():
            if m.model == model and m.serving:
                return m.active_version
        return 0

    def device_id(self) -> str:
        """Return the device id it enrolled as ("" before enrollment)."""
        status = self.status()
        return status.device_id if status is not None else ""

    def tail(self, lines: int = 5) -> str:
        """Return the last lines of its log, for an error message."""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class DemoAgents:
    """Start agent processes on enter; stop every one on exit."""

    def __init__(
        self,
        server: str,
        ca: Path | None,
        token: str,
        root: Path,
        agents: dict[str, dict[str, str]],
        report_interval_s: float = 2.0,
    ) -> None:
        self._server, self._ca, self._token = server, ca, token
        self._interval = report_interval_s
        root = _socket_root(root)
        self.agents = [
            DemoAgent(name, attrs, root / name, root / f"{name}.log")
            for name, attrs in agents.items()
        ]

    def __enter__(self) -> DemoAgents:
        try:
            for agent in self.agents:
                self._start(agent)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _start(self, agent: DemoAgent) -> None:
        agent.state.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "control_plane.cli", "agent", "run"]
        cmd += ["--server", self._server, "--state", str(agent.state)]
        if self._ca is not None:
            cmd += ["--ca", str(self._ca)]
        cmd += ["--enroll-token", self._token, "--json-log"]
        cmd += ["--report-interval", str(self._interval)]
        for key, value in agent.attributes.items():
            cmd += ["--attr", f"{key}={value}"]
        if shutil.which("setpriv"):
            cmd = ["setpriv", "--pdeathsig", "SIGTERM", "--", *cmd]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SKIFF_")}
        with agent.log.open("ab") as log:
            agent.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the demo, which stops them in order
            )

    def stop(self) -> None:
        """SIGTERM every agent, wait for them to drain, SIGKILL what is left."""
        running = [a.proc for a in self.agents if a.proc is not None and a.proc.poll() is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in running:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def wait(self, predicate, what: str, timeout: float = 120.0) -> None:
        """Wait until `predicate(agent)` holds for every agent; Unavailable naming who not."""
        deadline = time.monotonic() + timeout
        while True:
            pending = [a for a in self.agents if not predicate(a)]
            if not pending:
                return
            for a in pending:
                if a.proc is not None and a.proc.poll() is not None:
                    raise errors.Unavailable(
                        f"agent {a.name} exited ({a.proc.returncode}) before {what}:\n{a.tail()}"
                    )
            if time.monotonic() > deadline:
                names = ", ".join(a.name for a in pending)
                raise errors.Unavailable(f"agents {names}: not {what} after {timeout:g} s")
            time.sleep(0.2)


def _socket_root(root: Path) -> Path:
    """Return `root`, or a short temporary directory if sockets under it would be too long."""
    longest = Path(os.path.abspath(root)) / "agent-xx" / SOCKET_NAME
    if len(os.fsencode(longest)) <= MAX_SOCKET_PATH:
        return root
    short = Path(tempfile.mkdtemp(prefix="skiff-agents-"))
    print(f"   (agent state in {short}: sockets under {root} would be too long)", flush=True)
    return short
