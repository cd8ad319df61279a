"""Event pipelines on the device: events in, model results out to subscribed apps.

A version whose manifest carries a pipeline spec (`runtime.pipeline`) gets a native
`StreamEngine` next to its model. Apps push events (`AgentService.PushEvents`); each
trigger firing assembles the model input from its features, runs the serving version
through `Serving.infer` (so it counts in telemetry like any request, and crashes lead
to the same rollback), and the result goes to every app subscribed to the model
(`AgentService.Subscribe`), in firing order.

A new version swaps its pipeline together with its model. When the new spec is the same
as the old one the engine's state (windows, partial matches) carries over; otherwise
the new pipeline starts empty. Subscriptions outlive swaps and rollbacks: they follow
whatever version serves the model.

A subscriber that does not keep up loses its oldest results, never the agent's memory:
each subscription holds at most `QUEUE_RESULTS` results, and the next result delivered
says how many were dropped before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from device_agent.serving import NotServing, Serving
from device_agent.state import one_line
from device_agent.telemetry import Collector

log = logging.getLogger("skiff.agent")

MAX_EVENTS = 65_536
QUEUE_RESULTS = 1024
MAX_SUBSCRIBERS = 64


class EventsRejected(ValueError):
    """A pushed batch cannot be applied; nothing of it was (the message says why)."""


class NoPipeline(Exception):
    """The model is not installed, or its serving version has no pipeline."""

    def __init__(self, message: str, *, installed: bool) -> None:
        super().__init__(message)
        self.installed = installed


@dataclass
class Result:
    """One firing's outcome: outputs, or the error that stopped its model run."""

    model: str
    version: int
    trigger: str
    key: int
    ts: int
    window_start: int
    window_end: int
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    error: str = ""


@dataclass
class PushSummary:
    """What one PushEvents did."""

    version: int
    accepted: int
    firings: int
    errors: int


class Subscription:
    """One app's stream of a model's results (bounded; the oldest dropped first)."""

    def __init__(self, model: str, loop: asyncio.AbstractEventLoop) -> None:
        self.model = model
        self._loop = loop
        self._queue: asyncio.Queue[Result | None] = asyncio.Queue()
        self.dropped = 0

    def offer(self, result: Result | None) -> None:
        """Queue a result (None ends the stream); on the subscription's loop only."""
        if result is not None and self._queue.qsize() >= QUEUE_RESULTS:
            self._queue.get_nowait()
            self.dropped += 1
        self._queue.put_nowait(result)

    async def next(self) -> tuple[Result | None, int]:
        """Wait for the next result; return it (None: stream over) and the drops before it."""
        result = await self._queue.get()
        dropped, self.dropped = self.dropped, 0
        return result, dropped


@dataclass
class _Active:
    uid: str
    version: int
    pipeline: object  # runtime.pipeline.Pipeline
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipelines:
    """Every served model's pipeline and its subscribers; thread-safe."""

    def __init__(self, serving: Serving, collector: Collector) -> None:
        self._serving = serving
        self._collector = collector
        self._lock = threading.Lock()
        self._active: dict[str, _Active] = {}
        self._subscribers: dict[str, list[Subscription]] = {}
        self._broken: dict[str, str] = {}

    # -- versions ------------------------------------------------------------------------------

    def activate(self, name: str, info: dict, model) -> None:
        """Serve `model` (its pointer slot `info`) with its version's pipeline, as one swap.

        No push runs while the model and the pipeline change: a push in flight on the old
        pipeline finishes on the old version first, and the next one sees both new.
        """
        from runtime.pipeline import Pipeline, PipelineError

        new, broken = None, ""
        if info.get("pipeline") is not None:
            try:
                built = Pipeline.for_model(info["pipeline"], model.signature)
                new = _Active(info["uid"], info["version"], built)
            except (PipelineError, ValueError) as exc:
                # The self-test built it before activation: the pointer file is damaged.
                broken = f"v{info['version']}'s pipeline does not build: {exc}"
                log.error("%s %s", name, broken)
        with self._lock:
            old = self._active.get(name)
        with contextlib.ExitStack() as held:
            if old is not None:
                held.enter_context(old.lock)
            carried = new is not None and old is not None and new.pipeline.carry_over(old.pipeline)
            self._serving.put(name, info, model)
            with self._lock:
                if new is None:
                    self._active.pop(name, None)
                else:
                    self._active[name] = new
                if broken:
                    self._broken[name] = broken
                else:
                    self._broken.pop(name, None)
        if new is not None:
            state = "kept its state" if carried else "starts empty"
            log.info("%s v%d pipeline %s", name, new.version, state)

    def drop(self, name: str) -> None:
        """Forget `name`'s pipeline (the model was removed); its subscribers stay."""
        with self._lock:
            self._active.pop(name, None)
            self._broken.pop(name, None)

    def describe(self, name: str) -> dict | None:
        """Return the serving pipeline's spec (JSON data), or None."""
        with self._lock:
            active = self._active.get(name)
        return active.pipeline.spec.to_json() if active is not None else None

    # -- subscribers ---------------------------------------------------------------------------

    def subscribe(self, name: str) -> Subscription:
        """Start a subscription to `name`'s results (call on the event loop)."""
        self._check(name)
        sub = Subscription(name, asyncio.get_running_loop())
        with self._lock:
            subs = self._subscribers.setdefault(name, [])
            if len(subs) >= MAX_SUBSCRIBERS:
                raise EventsRejected(f"{name} already has {MAX_SUBSCRIBERS} subscribers")
            subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """End a subscription (the app went away)."""
        with self._lock:
            subs = self._subscribers.get(sub.model, [])
            if sub in subs:
                subs.remove(sub)

    def close(self) -> None:
        """End every subscription (the agent is stopping)."""
        with self._lock:
            subs = [s for group in self._subscribers.values() for s in group]
            self._subscribers.clear()
        for sub in subs:
            sub._loop.call_soon_threadsafe(sub.offer, None)

    def _check(self, name: str) -> _Active:
        with self._lock:
            active = self._active.get(name)
            broken = self._broken.get(name)
        if active is not None:
            return active
        serving = self._serving.serving(name)
        if broken:
            raise NoPipeline(f"{name}: {broken}", installed=True)
        if serving is None and name not in self._serving.names():
            raise NoPipeline(f"model {name} is not installed on this device", installed=False)
        version = f" v{serving['version']}" if serving else ""
        raise NoPipeline(f"{name}{version} has no event pipeline", installed=True)

    # -- events --------------------------------------------------------------------------------

    def push(
        self,
        name: str,
        key_fields: Sequence[str],
        value_fields: Sequence[str],
        events: Sequence,
    ) -> PushSummary:
        """Apply a batch of `agent_pb2.Event`s and run the model at each firing.

        Raises NoPipeline, or EventsRejected naming the first bad event (the batch is
        then not applied at all). Firings whose model run fails are sent to subscribers
        with their error and counted in `errors`.
        """
        active = self._check(name)
        while True:
            with active.lock:
                current = self._check(name)
                if current is active:
                    return self._push(name, active, key_fields, value_fields, events)
            active = current  # swapped while this push waited: the new version takes it

    def _push(self, name: str, active: _Active, key_fields, value_fields, events) -> PushSummary:
        from runtime.stream_spec import BatchFormatError, StreamInputError

        pipeline = active.pipeline
        arrays = _arrays(pipeline.spec.config, key_fields, value_fields, events)
        try:
            firings = pipeline.push(*arrays)
        except (StreamInputError, BatchFormatError) as exc:
            raise EventsRejected(str(exc)) from None
        errors = 0
        for firing in firings:
            result = self._run(name, active, firing)
            errors += bool(result.error)
            self._publish(name, result)
        return PushSummary(active.version, len(events), len(firings), errors)

    def _run(self, name: str, active: _Active, firing) -> Result:
        from runtime import RuntimeFailure

        result = Result(
            model=name,
            version=active.version,
            trigger=firing.trigger,
            key=firing.key,
            ts=firing.ts,
            window_start=firing.window_start,
            window_end=firing.window_end,
        )
        try:
            info, config, outputs, _ = self._serving.infer(name, firing.inputs)
        except (NotServing, RuntimeFailure) as exc:
            result.error = one_line(exc, 500)
            return result
        except Exception as exc:  # noqa: BLE001 - one bad firing never stops the batch
            log.error("%s pipeline firing failed: %s: %s", name, type(exc).__name__, exc)
            result.error = f"internal error: {type(exc).__name__}"
            return result
        result.version, result.outputs = info["version"], outputs
        self._collector.firings((name, info["version"], info["variant"], config), 1)
        return result

    def _publish(self, name: str, result: Result) -> None:
        with self._lock:
            subs = list(self._subscribers.get(name, ()))
        for sub in subs:  # FIFO on each loop: results arrive in firing order
            sub._loop.call_soon_threadsafe(sub.offer, result)


def _arrays(config, key_fields: Sequence[str], value_fields: Sequence[str], events: Sequence):
    """Return (ts, types, keys, values) in the pipeline's field order; EventsRejected if not."""
    if len(events) > MAX_EVENTS:
        raise EventsRejected(f"{len(events)} events in one push; at most {MAX_EVENTS}")
    key_order = _order("key_fields", key_fields, config.key_fields)
    value_order = _order("value_fields", value_fields, config.value_fields)
    n, nk, nv = len(events), len(key_fields), len(value_fields)
    ts = np.empty(n, dtype=np.int64)
    types: list[str] = []
    keys: list[int] = []
    values: list[float] = []
    for i, e in enumerate(events):
        if len(e.keys) != nk or len(e.values) != nv:
            raise EventsRejected(
                f"event {i}: {len(e.keys)} keys and {len(e.values)} values; "
                f"key_fields and value_fields name {nk} and {nv}"
            )
        ts[i] = e.ts_ms
        types.append(e.type)
        keys.extend(e.keys)
        values.extend(e.values)
    key_array = np.array(keys, dtype=np.int64).reshape(n, nk)[:, key_order]
    value_array = np.array(values, dtype=np.float64).reshape(n, nv)[:, value_order]
    return ts, types, np.ascontiguousarray(key_array), np.ascontiguousarray(value_array)


def _order(what: str, given: Sequence[str], expected: tuple[str, ...]) -> list[int]:
    """Return the columns of `given` in `expected`'s order; EventsRejected if not the same set."""
    if sorted(given) != sorted(expected) or len(set(given)) != len(given):
        raise EventsRejected(
            f"{what} must name the pipeline's fields {list(expected)}, got {list(given)[:20]}"
        )
    index = {name: i for i, name in enumerate(given)}
    return [index[name] for name in expected]
