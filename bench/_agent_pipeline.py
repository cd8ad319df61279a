"""bench/agent.py's pipeline figures: events through the agent, against in-process.

The same shopping events go through `PushEvents` in batches of BATCH until every
firing's model result reached a subscriber in this process: as `Event` messages with
`Subscribe`; then, an hour later (the engine has moved past the first ones), with
`SubscribeBatches`; then as `EventColumns` with `SubscribeBatches`. The baseline is the
same pipeline and model run in this process (`runtime.pipeline.Pipeline` + an in-process
`runtime.Model`, one run per firing), the median of ROUNDS runs.

The floor under the first way: a bare grpc.aio server in a process of its own (as the
agent's is) that answers the same `PushEventsRequest`s without reading them and streams,
for each, as many copies of one real `PipelineResult` as that push fired in the agent,
to the same kind of reader: what the API's shape (a message per event, a message per
result) costs with no work behind it; the median of ROUNDS rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc

from control_plane.demo import sample_models
from control_plane.demo.sample_pipeline import activity_events, activity_pipeline, event_messages
from protos import agent_pb2
from runtime.pipeline import Pipeline, parse_pipeline

BATCH = 1000
HOUR_MS = 3_600_000
ROUNDS = 5  # the floor and the in-process baseline: medians of this many


def pipeline_figures(stub, model: str, tmp: Path, n: int) -> dict:
    """Push n events three ways through the agent's `model`; print and return the figures."""
    figures: dict = {}
    events = activity_events(n, users=1000, seed=3)
    took, fired, per_push, sample = pipeline_through_agent(stub, model, events)
    later = activity_events(n, users=1000, seed=3, start_ms=int(events[0][-1]) + HOUR_MS)
    batched_took, batched_fired, _, _ = pipeline_through_agent(stub, model, later, batched=True)
    last = activity_events(n, users=1000, seed=3, start_ms=int(later[0][-1]) + HOUR_MS)
    columns_took, columns_fired, _, _ = pipeline_through_agent(
        stub, model, last, batched=True, columns=True
    )
    floor_took = pipeline_floor(model, events, per_push, sample, tmp)
    assert batched_fired == columns_fired == fired, (batched_fired, columns_fired, fired)
    v2 = tmp / "small-2.mnn"  # the agent serves `model` v2: the same tiny model
    v2.write_bytes(sample_models.onnx_to_mnn_bytes(sample_models.tiny_mlp_onnx(seed=2)))
    base_took, base_fired = pipeline_in_process(v2, events)
    assert fired == base_fired, (fired, base_fired)
    figures["pipeline_events"] = n
    figures["pipeline_firings"] = fired
    figures["pipeline_events_per_s"] = round(n / took)
    figures["in_process_events_per_s"] = round(n / base_took)
    figures["pipeline_vs_in_process"] = round(base_took / took, 3)
    figures["pipeline_floor_events_per_s"] = round(n / floor_took)
    figures["pipeline_floor_vs_in_process"] = round(base_took / floor_took, 3)
    figures["pipeline_vs_floor"] = round(floor_took / took, 3)
    figures["pipeline_batched_events_per_s"] = round(n / batched_took)
    figures["pipeline_batched_vs_in_process"] = round(base_took / batched_took, 3)
    figures["pipeline_columns_events_per_s"] = round(n / columns_took)
    figures["pipeline_columns_vs_in_process"] = round(base_took / columns_took, 3)
    print(
        f"pipeline: {n} events -> {fired} firings -> results to a subscriber: "
        f"{n / took:,.0f} events/s through the agent, {n / base_took:,.0f} in-process "
        f"(ratio {base_took / took:.2f}; a bare server's floor for that shape "
        f"{n / floor_took:,.0f}, ratio {base_took / floor_took:.2f}); results in batches "
        "(SubscribeBatches): "
        f"{n / batched_took:,.0f} events/s (ratio {base_took / batched_took:.2f}); and "
        f"the events as columns (EventColumns): {n / columns_took:,.0f} events/s "
        f"(ratio {base_took / columns_took:.2f})",
        flush=True,
    )
    return figures


def push_requests(model: str, events, *, columns: bool = False) -> list:
    """`events` as PushEventsRequests of BATCH events: `Event` messages, or `columns`."""
    ts, types, keys, values = events
    fields = {"model": model, "key_fields": ["user"], "value_fields": ["dwell_ms", "amount"]}
    requests = []
    for lo in range(0, len(ts), BATCH):
        part = slice(lo, lo + BATCH)
        if columns:
            cols = agent_pb2.EventColumns(
                ts_ms=ts[part].tolist(),
                types=types[part],
                keys=keys[part].ravel().tolist(),
                values=values[part].ravel().tolist(),
            )
            requests.append(agent_pb2.PushEventsRequest(**fields, columns=cols))
        else:
            evs = event_messages(ts[part], types[part], keys[part], values[part])
            requests.append(agent_pb2.PushEventsRequest(**fields, events=evs))
    return requests


def pushed_and_read(push, subscribe, requests, *, batched: bool) -> tuple[float, list[int], bytes]:
    """Push `requests` while a thread reads `subscribe`'s stream until every result came.

    Returns the seconds that took, each push's firings, and the first result's bytes.
    """
    got, first = [0], []
    call = subscribe(agent_pb2.SubscribeRequest(model=requests[0].model))

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):
            for message in call:
                for result in message.results if batched else [message]:
                    assert not result.error, result.error
                    if not first:
                        first.append(result.SerializeToString())
                    got[0] += 1

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.5)
    start = time.perf_counter()
    per_push = [push(r, timeout=300).firings for r in requests]
    while got[0] < sum(per_push):
        time.sleep(0.001)
    took = time.perf_counter() - start
    call.cancel()
    return took, per_push, first[0] if first else b""


def pipeline_through_agent(
    stub, model: str, events, *, batched: bool = False, columns: bool = False
) -> tuple[float, int, list[int], bytes]:
    """Push `events` in batches; return seconds until every result arrived, and firings.

    The events go as one message each (`Event`) or as `columns` (`EventColumns`); the
    results come one a message (Subscribe) or `batched` (SubscribeBatches). Also returns
    each push's firings and the first result's bytes (what the floor sends).
    """
    requests = push_requests(model, events, columns=columns)
    subscribe = stub.SubscribeBatches if batched else stub.Subscribe
    took, per_push, sample = pushed_and_read(stub.PushEvents, subscribe, requests, batched=batched)
    return took, sum(per_push), per_push, sample


def pipeline_floor(
    model: str, events, per_push: list[int], sample: bytes, tmp: Path, rounds: int = ROUNDS
) -> float:
    """Seconds the floor's bare server takes for what `pipeline_through_agent` did.

    The median of `rounds` (a round is a tenth of a second: one alone is noise).
    """
    path, script = tmp / "pipeline-floor.sock", tmp / "pipeline-floor.json"
    script.write_text(json.dumps({"per_push": per_push, "result": sample.hex()}))
    server = subprocess.Popen([sys.executable, __file__, str(path), str(script)])
    try:
        while not path.exists():
            if server.poll() is not None:
                raise RuntimeError("the pipeline floor's server did not start")
            time.sleep(0.05)
        with grpc.insecure_channel(f"unix:{path}") as channel:
            push = channel.unary_unary(
                f"/{FLOOR}/Push",
                request_serializer=agent_pb2.PushEventsRequest.SerializeToString,
                response_deserializer=agent_pb2.PushEventsResponse.FromString,
            )
            subscribe = channel.unary_stream(
                f"/{FLOOR}/Subscribe",
                request_serializer=agent_pb2.SubscribeRequest.SerializeToString,
                response_deserializer=agent_pb2.PipelineResult.FromString,
            )
            requests = push_requests(model, events)
            took = []
            for _ in range(rounds):
                seconds, got, _ = pushed_and_read(push, subscribe, requests, batched=False)
                assert got == per_push, (got, per_push)
                took.append(seconds)
        return statistics.median(took)
    finally:
        server.kill()
        server.wait()


FLOOR = "skiff.bench.PipelineFloor"


def serve_floor(path: str, script: str) -> None:
    """The floor's server: push i answers per_push[i] and queues that many results.

    Round after round: after the last push, the first again.
    """
    from device_agent.local_api import SERVER_OPTIONS

    told = json.loads(Path(script).read_text())
    per_push, result = told["per_push"], bytes.fromhex(told["result"])

    async def serve() -> None:
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        pushes = itertools.cycle(per_push)

        async def push(request: bytes, context) -> bytes:
            fired = next(pushes)
            for _ in range(fired):
                queue.put_nowait(result)
            return agent_pb2.PushEventsResponse(firings=fired).SerializeToString()

        async def subscribe(request: bytes, context):
            while True:
                yield await queue.get()

        server = grpc.aio.server(options=SERVER_OPTIONS)
        handlers = {
            "Push": grpc.unary_unary_rpc_method_handler(push),
            "Subscribe": grpc.unary_stream_rpc_method_handler(subscribe),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(FLOOR, handlers),))
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def pipeline_in_process(mnn: Path, events, rounds: int = ROUNDS) -> tuple[float, int]:
    """The same events through the same pipeline and model in this process.

    The median of `rounds`, each with a pipeline of its own (as fresh as the agent's).
    """
    from runtime import Model

    ts, types, keys, values = events
    spec = parse_pipeline(activity_pipeline())
    took, fired = [], set()
    with Model.from_bytes(mnn.read_bytes(), isolation="in_process") as model:
        for _ in range(rounds):
            fit = spec.fit([{"name": "x", "shape": [1, 16], "dtype": "float32"}])
            pipeline = Pipeline(spec, fit)
            start = time.perf_counter()
            count = 0
            for lo in range(0, len(ts), BATCH):
                hi = lo + BATCH
                for firing in pipeline.push(ts[lo:hi], types[lo:hi], keys[lo:hi], values[lo:hi]):
                    model.run(firing.inputs)
                    count += 1
            took.append(time.perf_counter() - start)
            fired.add(count)
    assert len(fired) == 1, fired
    return statistics.median(took), fired.pop()


if __name__ == "__main__":  # the floor's server, started by pipeline_floor
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    serve_floor(*sys.argv[1:])
