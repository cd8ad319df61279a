"""bench/agent.py's pipeline figures: events through the agent, against in-process.

The same shopping events go through `PushEvents` in batches of BATCH until every
firing's model result reached a subscriber in this process: as `Event` messages with
`Subscribe`; then, an hour later (the engine has moved past the first ones), with
`SubscribeBatches`; then as `EventColumns` with `SubscribeBatches`. The baseline is the
same pipeline and model run in this process (`runtime.pipeline.Pipeline` + an in-process
`runtime.Model`, one run per firing).
"""

from __future__ import annotations

import contextlib
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


def pipeline_figures(stub, model: str, tmp: Path, n: int) -> dict:
    """Push n events three ways through the agent's `model`; print and return the figures."""
    figures: dict = {}
    events = activity_events(n, users=1000, seed=3)
    took, fired = pipeline_through_agent(stub, model, events)
    later = activity_events(n, users=1000, seed=3, start_ms=int(events[0][-1]) + HOUR_MS)
    batched_took, batched_fired = pipeline_through_agent(stub, model, later, batched=True)
    last = activity_events(n, users=1000, seed=3, start_ms=int(later[0][-1]) + HOUR_MS)
    columns_took, columns_fired = pipeline_through_agent(
        stub, model, last, batched=True, columns=True
    )
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
    figures["pipeline_batched_events_per_s"] = round(n / batched_took)
    figures["pipeline_batched_vs_in_process"] = round(base_took / batched_took, 3)
    figures["pipeline_columns_events_per_s"] = round(n / columns_took)
    figures["pipeline_columns_vs_in_process"] = round(base_took / columns_took, 3)
    print(
        f"pipeline: {n} events -> {fired} firings -> results to a subscriber: "
        f"{n / took:,.0f} events/s through the agent, {n / base_took:,.0f} in-process "
        f"(ratio {base_took / took:.2f}); results in batches (SubscribeBatches): "
        f"{n / batched_took:,.0f} events/s (ratio {base_took / batched_took:.2f}); and "
        f"the events as columns (EventColumns): {n / columns_took:,.0f} events/s "
        f"(ratio {base_took / columns_took:.2f})",
        flush=True,
    )
    return figures


def pipeline_through_agent(
    stub, model: str, events, *, batched: bool = False, columns: bool = False
) -> tuple[float, int]:
    """Push `events` in batches; return seconds until every result arrived, and firings.

    The events go as one message each (`Event`) or as `columns` (`EventColumns`); the
    results come one a message (Subscribe) or `batched` (SubscribeBatches).
    """
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
    got = [0]
    subscribe = stub.SubscribeBatches if batched else stub.Subscribe
    call = subscribe(agent_pb2.SubscribeRequest(model=model))

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):
            for message in call:
                for result in message.results if batched else [message]:
                    assert not result.error, result.error
                    got[0] += 1

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.5)
    start = time.perf_counter()
    fired = sum(stub.PushEvents(r, timeout=300).firings for r in requests)
    while got[0] < fired:
        time.sleep(0.001)
    took = time.perf_counter() - start
    call.cancel()
    return took, fired


def pipeline_in_process(mnn: Path, events) -> tuple[float, int]:
    """The same events through the same pipeline and model in this process."""
    from runtime import Model

    ts, types, keys, values = events
    spec = parse_pipeline(activity_pipeline())
    with Model.from_bytes(mnn.read_bytes(), isolation="in_process") as model:
        pipeline = Pipeline(spec, spec.fit([{"name": "x", "shape": [1, 16], "dtype": "float32"}]))
        start = time.perf_counter()
        fired = 0
        for lo in range(0, len(ts), BATCH):
            hi = lo + BATCH
            for firing in pipeline.push(ts[lo:hi], types[lo:hi], keys[lo:hi], values[lo:hi]):
                model.run(firing.inputs)
                fired += 1
        return time.perf_counter() - start, fired
