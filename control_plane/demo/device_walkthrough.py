"""What apps on a device do with an agent, in `skiff demo`: events in, results out; infer.

Runs while version 2 (the one with the event pipeline) is out: an app subscribes to the
model's results on one agent, another pushes a few thousand shopping events, and the
pipeline's firings come back as model scores. Then `skiff infer` runs the model once
through the same agent, as a script on the device would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np

from contract import errors
from contract.local_api import to_array
from control_plane.demo.demo_agents import DemoAgent
from control_plane.demo.sample_pipeline import activity_events, event_messages
from protos import agent_pb2
from runtime.npz import write_npz

EVENTS = 3000
BATCH = 500
SHOWN = 3


def _say(text: str) -> None:
    print(text, flush=True)


def show_pipeline(agent: DemoAgent, model: str, figures: dict) -> None:
    """Subscribe to `model`'s results on `agent`, push events, print what comes back."""
    _say(f"\n== events -> pipeline -> model on {agent.name}")
    status = agent.status()
    triggers = next((list(m.pipeline_triggers) for m in status.models if m.model == model), [])
    _say(f"   {model} on {agent.name} runs pipeline triggers {triggers}")
    results: list[agent_pb2.PipelineResult] = []
    call = agent.stub().Subscribe(agent_pb2.SubscribeRequest(model=model))

    def read() -> None:
        try:
            for r in call:
                results.append(r)
        except grpc.RpcError:
            pass  # cancelled below

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.3)  # the subscription is in place before the first event
    ts, types, keys, values = activity_events(EVENTS, users=50, seed=11)
    fired, stub = 0, agent.stub()
    started = time.perf_counter()
    for lo in range(0, EVENTS, BATCH):
        hi = lo + BATCH
        events = event_messages(ts[lo:hi], types[lo:hi], keys[lo:hi], values[lo:hi])
        reply = stub.PushEvents(
            agent_pb2.PushEventsRequest(
                model=model,
                key_fields=["user"],
                value_fields=["dwell_ms", "amount"],
                events=events,
            ),
            timeout=120,
        )
        fired += reply.firings
    took = time.perf_counter() - started
    deadline = time.monotonic() + 30
    while len(results) < fired and time.monotonic() < deadline:
        time.sleep(0.05)
    call.cancel()
    reader.join(5)
    if len(results) < fired:
        raise errors.Unavailable(f"{fired} firings, but only {len(results)} results arrived")
    for r in results[:SHOWN]:
        scores = ", ".join(f"{x:+.3f}" for x in to_array(r.outputs[0]).ravel())
        at = (r.event_ts_ms - int(ts[0])) / 1000
        _say(f"   user {r.key:>2} at +{at:6.2f}s  {r.trigger} -> [{scores}]  (v{r.version})")
    figures.update(events=EVENTS, firings=fired, results=len(results), events_s=took)
    _say(
        f"   {EVENTS} events in {EVENTS // BATCH} PushEvents calls -> {fired} firings -> "
        f"{len(results)} results to the subscriber ({took:.2f}s, {EVENTS / took:,.0f} events/s)"
    )


def show_infer(agent: DemoAgent, model: str, work: Path, figures: dict) -> None:
    """Run `skiff infer` through `agent` and print what it answered."""
    inputs = work / "infer-input.npz"
    inputs.write_bytes(write_npz({"x": np.linspace(-1, 1, 16, dtype=np.float32).reshape(1, 16)}))
    cmd = [sys.executable, "-m", "control_plane.cli", "infer", "--state", str(agent.state)]
    cmd += [model, "--input", str(inputs), "--json"]
    _say(f"\n== skiff infer --state {agent.state} {model} --input {inputs.name} --json")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKIFF_")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    if done.returncode != 0:
        raise errors.Unavailable(f"skiff infer failed ({done.returncode}): {done.stderr.strip()}")
    body = json.loads(done.stdout)
    ((name, out),) = body["outputs"].items()
    figures.update(infer_version=body["version"], infer_us=body["latency_us"])
    _say(
        f"   {model}:{body['version']} ({body['variant']}, {body['config']}) answered {name} "
        f"{out['shape']} in {body['latency_us']:.0f} µs"
    )
