"""Event pipelines on the device: events in, model results out to subscribed apps.

A version whose manifest carries a pipeline spec (`runtime.pipeline`) gets a native
`StreamEngine` next to its model. Apps push events (`AgentService.PushEvents`); each
trigger firing assembles the model input from its features, the serving version runs
on all of one push's firings in one batch (`Serving.infer_batch`: one round trip to the
worker, each firing counted in telemetry like a request, crashes leading to the same
rollback), and the results go to every app subscribed to the model
(`AgentService.Subscribe`), in firing order.

A new version swaps its pipeline together with its model. When the new spec is the same
as the old one the engine's state (windows, partial matches) carries over; otherwise
the new pipeline starts empty. Subscriptions outlive swaps and rollbacks: they follow
whatever version serves the model.

A subscriber that does not keep up loses its oldest results, never the agent's memory:
each subscription holds at most `QUEUE_RESULTS` results and `QUEUE_BYTES` of outputs,
and the next result delivered says how many were dropped before it. A push is bounded
too: in events, in the feature rows its firings may hold (`PUSH_BYTES`), and in time
(events more than `MAX_AHEAD_MS` ahead of the device's clock are refused, so one wrong
timestamp cannot push the watermark into the future and make every later event late).
A push whose caller gave up before it was applied is not applied; one the caller gave
up on while its model runs completes: a retry after DEADLINE_EXCEEDED may apply a batch
twice (at-least-once).

What apps may ask of a model in all is bounded as well (`device_agent.local_quotas`): events
and model runs a second, and open subscriptions. `admit` lets a push in or refuses it
whole (Overloaded) before it queues for the model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from device_agent.local_quotas import MAX_EVENTS, AppLimits, Overloaded, RateLimits
from device_agent.pipeline_results import Result, Subscription
from device_agent.report_outbox import Collector
from device_agent.serving import NotServing, Serving
from device_agent.state import one_line

TYPE_CHECKING = False  # an idle agent (no pipeline pushed to) never imports numpy
if TYPE_CHECKING:
    pass

log = logging.getLogger("skiff.agent")

# What one push may hold of feature rows and firings; a wider pipeline takes fewer events.
PUSH_BYTES = 128 << 20
# Events further ahead of this device's clock are refused: one bad timestamp would move
# the engine's watermark on, and every event after it would be "late".
MAX_AHEAD_MS = 3_600_000


class EventsRejected(ValueError):
    """A pushed batch cannot be applied; nothing of it was (the message says why).

    `reason` is "invalid" (malformed, or an event the pipeline does not know), "late"
    (behind the watermark by more than the lateness) or "ahead" (in the future).
    """

    def __init__(self, message: str, reason: str = "invalid") -> None:
        super().__init__(message)
        self.reason = reason


class NoPipeline(Exception):
    """The model is not installed, is loading, or its serving version has no pipeline."""

    def __init__(self, message: str, *, installed: bool, loading: bool = False) -> None:
        super().__init__(message)
        self.installed, self.loading = installed, loading


class Closed(Exception):
    """The agent is stopping: no new subscription."""


@dataclass
class PushSummary:
    """What one PushEvents did."""

    version: int
    accepted: int
    firings: int
    errors: int


@dataclass
class _Active:
    uid: str
    version: int
    pipeline: object  # runtime.pipeline.Pipeline
    lock: threading.Lock = field(default_factory=threading.Lock)


class Pipelines:
    """Every served model's pipeline and its subscribers; thread-safe.

    `limits` bound what apps ask of each model; `clock` (monotonic seconds) paces them.
    """

    def __init__(
        self,
        serving: Serving,
        collector: Collector,
        limits: AppLimits | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._serving = serving
        self._collector = collector
        self.limits = limits or AppLimits()
        self._rates = RateLimits(self.limits, clock)
        self._lock = threading.Lock()
        self._active: dict[str, _Active] = {}
        self._subscribers: dict[str, list[Subscription]] = {}
        self._broken: dict[str, str] = {}
        self._closed = False

    # -- versions ------------------------------------------------------------------------------

    def activate(self, name: str, info: dict, model) -> None:
        """Serve `model` (its pointer slot `info`) with its version's pipeline, as one swap.

        Blocking (call it off the event loop). Pushes from now on go to the new pipeline
        and wait until the new model serves; a push already running on the old pipeline
        finishes there (an equal spec's state is carried over once it has).
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
        with contextlib.ExitStack() as held:
            if new is not None:
                held.enter_context(new.lock)  # taken before anyone can see it
            with self._lock:
                old = self._active.pop(name, None)
                if new is not None:
                    self._active[name] = new
                if broken:
                    self._broken[name] = broken
                else:
                    self._broken.pop(name, None)
            carried = False
            if new is not None and old is not None:
                with old.lock:  # only the push in flight, if any: later ones wait on new
                    carried = _carry_over(name, new, old)
            self._serving.put(name, info, model)
        if new is not None:
            state = "kept its state" if carried else "starts empty"
            log.info("%s v%d pipeline %s", name, new.version, state)

    def drop(self, name: str) -> None:
        """Forget `name`'s pipeline (the model was removed); its subscribers stay."""
        with self._lock:
            self._active.pop(name, None)
            self._broken.pop(name, None)
        self._rates.forget(name)

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
            if self._closed:
                raise Closed("the agent is stopping")
            subs = self._subscribers.setdefault(name, [])
            if len(subs) >= self.limits.subscribers:
                raise Overloaded(
                    f"{name} already has {len(subs)} subscribers, at most "
                    f"{self.limits.subscribers} per model: retry once one has left"
                )
            subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        """End a subscription (the app went away)."""
        with self._lock:
            subs = self._subscribers.get(sub.model, [])
            if sub in subs:
                subs.remove(sub)

    def close(self) -> None:
        """End every subscription and refuse new ones (the agent is stopping)."""
        with self._lock:
            self._closed = True
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
        if broken:
            raise NoPipeline(f"{name}: {broken}", installed=True)
        serving = self._serving.serving(name)
        if serving is None and self._serving.is_loading(name):
            raise NoPipeline(
                f"model {name} is loading: try again shortly", installed=True, loading=True
            )
        if serving is None:
            raise NoPipeline(f"model {name} is not installed on this device", installed=False)
        raise NoPipeline(f"{name} v{serving['version']} has no event pipeline", installed=True)

    # -- events --------------------------------------------------------------------------------

    def admit(self, name: str, events: int) -> None:
        """Let a push of `events` events to `name` in, before it queues (cheap: any thread).

        Raises NoPipeline; EventsRejected if the push is larger than the burst (it would
        never get in); Overloaded (with `retry_after_s`) if it is over the model's rate
        now. A push refused here took nothing from the bucket and applies nothing.
        """
        self._check(name)
        if events > self.limits.events_burst:
            raise EventsRejected(f"{events} events in one push; at most {self.limits.events_burst}")
        self._rates.admit(name, events)

    def push(
        self,
        name: str,
        key_fields: Sequence[str],
        value_fields: Sequence[str],
        events: Sequence | Columns,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> PushSummary:
        """Apply a batch of `agent_pb2.Event`s (or `Columns`), run the model at each firing.

        Let it in with `admit` first: pushes are not paced here, only their firings
        counted against the model's runs a second. Raises NoPipeline, or EventsRejected
        naming the first bad event (the batch is then not applied at all). Firings
        whose model run fails are sent to subscribers with their error and counted in
        `errors`. A batch whose caller has gone (`cancelled()`) before it is applied is
        not applied.
        """
        active = self._check(name)
        while True:
            with active.lock:
                current = self._check(name)
                if current is active:
                    if cancelled():
                        raise EventsRejected("the caller cancelled the push", "cancelled")
                    return self._push(name, active, key_fields, value_fields, events)
            active = current  # swapped while this push waited: the new version takes it

    def _push(self, name: str, active: _Active, key_fields, value_fields, events) -> PushSummary:
        from runtime.stream_spec import BatchFormatError, LateEventError, StreamInputError

        pipeline = active.pipeline
        per_event = sum(t.spec.width * 8 + 256 for t in pipeline.spec.triggers)
        if len(events) * per_event > PUSH_BYTES:
            raise EventsRejected(
                f"{len(events)} events in one push; this pipeline takes at most "
                f"{PUSH_BYTES // per_event} per push"
            )
        arrays = _arrays(pipeline.spec.config, key_fields, value_fields, events)
        try:
            firings = pipeline.push(*arrays)
        except LateEventError as exc:
            raise EventsRejected(str(exc), "late") from None
        except (StreamInputError, BatchFormatError) as exc:
            raise EventsRejected(str(exc)) from None
        self._rates.charge_runs(name, len(firings))
        results = self._run(name, active, firings)
        self._publish(name, results)
        errors = sum(bool(r.error) for r in results)
        return PushSummary(active.version, len(events), len(firings), errors)

    def _run(self, name: str, active: _Active, firings: Sequence) -> list[Result]:
        """Run the model on every firing, in one batch; return their results in order."""
        from runtime import RuntimeFailure
        from runtime.pipeline import FeatureOverflow

        results, batch, runs = [], [], []
        for firing in firings:
            result = Result(
                model=name,
                version=active.version,
                trigger=firing.trigger,
                key=firing.key,
                ts=firing.ts,
                window_start=firing.window_start,
                window_end=firing.window_end,
            )
            results.append(result)
            try:
                batch.append(firing.inputs)
            except FeatureOverflow as exc:
                result.error = one_line(exc, 500)
            else:
                runs.append(result)
        if not batch:
            return results
        try:
            info, config, answers = self._serving.infer_batch(name, batch)
        except NotServing as exc:
            for result in runs:
                result.error = one_line(exc, 500)
            return results
        except Exception as exc:  # noqa: BLE001 - one bad push never takes the agent down
            log.error("%s pipeline firings failed: %s: %s", name, type(exc).__name__, exc)
            for result in runs:
                result.error = f"internal error: {type(exc).__name__}"
            return results
        for result, answer in zip(runs, answers, strict=True):
            if isinstance(answer, RuntimeFailure):
                result.error = one_line(answer, 500)
            elif isinstance(answer, Exception):
                result.error = f"internal error: {type(answer).__name__}"
            else:
                result.version, result.outputs = info["version"], answer
        ran = len(runs) - sum(bool(r.error) for r in runs)
        if ran:
            self._collector.firings((name, info["version"], info["variant"], config), ran)
        return results

    def _publish(self, name: str, results: list[Result]) -> None:
        if not results:
            return
        with self._lock:
            subs = list(self._subscribers.get(name, ()))
        for sub in subs:  # FIFO on each loop: results arrive in firing order
            sub._loop.call_soon_threadsafe(sub.offer_all, results)


def _carry_over(name: str, new: _Active, old: _Active) -> bool:
    """Give `new` the old pipeline's state if their specs are equal; never fail a swap."""
    try:
        return new.pipeline.carry_over(old.pipeline)
    except Exception as exc:  # noqa: BLE001 - e.g. MemoryError: the new one starts empty
        log.error("%s: pipeline state not carried over (%s): starts empty", name, exc)
        return False


class Columns:
    """A push's events given as columns (`agent_pb2.EventColumns`); len() is their number."""

    def __init__(self, columns) -> None:
        self.columns = columns

    def __len__(self) -> int:
        return len(self.columns.ts_ms)

    def flat(self, nk: int, nv: int):
        """Return (ts, types, keys, values), keys and values flat.

        EventsRejected if a column does not hold one entry an event (keys and values: one
        a field of an event).
        """
        import numpy as np

        c, n = self.columns, len(self)
        for what, have, want in (
            ("types", len(c.types), n),
            ("keys", len(c.keys), n * nk),
            ("values", len(c.values), n * nv),
        ):
            if have != want:
                raise EventsRejected(
                    f"columns: {have} {what} for {n} events of {nk} key and {nv} value "
                    f"fields ({want} expected)"
                )
        return (
            np.array(c.ts_ms, dtype=np.int64),
            list(c.types),
            np.array(c.keys, dtype=np.int64),
            np.array(c.values, dtype=np.float64),
        )


def _rows_flat(events: Sequence, nk: int, nv: int):
    """Return (ts, types, keys, values) of `agent_pb2.Event`s, keys and values flat."""
    import numpy as np

    n = len(events)
    # Field by field over all events, not event by event: each attribute read of a
    # message costs more than the loop around it.
    keys, values = [e.keys for e in events], [e.values for e in events]
    if set(map(len, keys)) - {nk} or set(map(len, values)) - {nv}:
        i = next(i for i in range(n) if len(keys[i]) != nk or len(values[i]) != nv)
        raise EventsRejected(
            f"event {i}: {len(keys[i])} keys and {len(values[i])} values; "
            f"key_fields and value_fields name {nk} and {nv}"
        )
    return (
        np.fromiter([e.ts_ms for e in events], np.int64, n),
        [e.type for e in events],
        np.fromiter(itertools.chain.from_iterable(keys), np.int64, n * nk),
        np.fromiter(itertools.chain.from_iterable(values), np.float64, n * nv),
    )


def _arrays(config, key_fields: Sequence[str], value_fields: Sequence[str], events):
    """Return (ts, types, keys, values) in the pipeline's field order; EventsRejected if not.

    `events`: `agent_pb2.Event`s, or `Columns`.
    """
    import numpy as np

    if len(events) > MAX_EVENTS:
        raise EventsRejected(f"{len(events)} events in one push; at most {MAX_EVENTS}")
    key_order = _order("key_fields", key_fields, config.key_fields)
    value_order = _order("value_fields", value_fields, config.value_fields)
    n, nk, nv = len(events), len(key_fields), len(value_fields)
    flat = events.flat if isinstance(events, Columns) else functools.partial(_rows_flat, events)
    ts, types, flat_keys, flat_values = flat(nk, nv)
    ahead = time.time_ns() // 1_000_000 + MAX_AHEAD_MS
    if n and int(ts.max()) > ahead:
        i = int(np.argmax(ts > ahead))
        raise EventsRejected(
            f"event {i}: ts {int(ts[i])} ms is more than {MAX_AHEAD_MS // 60_000} minutes "
            "ahead of this device's clock (epoch milliseconds expected)",
            "ahead",
        )
    key_array = flat_keys.reshape(n, nk)[:, key_order]
    value_array = flat_values.reshape(n, nv)[:, value_order]
    return ts, types, np.ascontiguousarray(key_array), np.ascontiguousarray(value_array)


def _order(what: str, given: Sequence[str], expected: tuple[str, ...]) -> list[int]:
    """Return the columns of `given` in `expected`'s order; EventsRejected if not the same set."""
    if sorted(given) != sorted(expected) or len(set(given)) != len(given):
        raise EventsRejected(
            f"{what} must name the pipeline's fields {list(expected)}, got {list(given)[:20]}"
        )
    index = {name: i for i, name in enumerate(given)}
    return [index[name] for name in expected]
