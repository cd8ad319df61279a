"""What the agent serves: loading installed versions, promotions, roll-backs, status.

`ServingSlots` is the serving half of `device_agent.agent.Agent` (a mixin: it uses the
agent's installer, serving tables, sync lock, telemetry queue and status thread). An
activated version is loaded in a worker and swapped in; one that cannot load here, or
fails at run time, is rolled back to the previous version (reported as such); one that
could not load for a passing reason (a busy machine) is tried again after LOAD_RETRY_S.
A promoted version that serves on its predecessor's config has its other configs probed
while it serves.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from device_agent.install import IntegrityFailure
from device_agent.report_outbox import rollback_reports
from device_agent.state import AgentError, one_line
from protos import agent_pb2

log = logging.getLogger("skiff.agent")

# A version that could not load for a passing reason (busy machine) is tried again.
LOAD_RETRY_S = 30.0


class ServingSlots:
    """Serving for `Agent` (mixin)."""

    async def _load_installed(self) -> None:
        """Load every installed model's active version to serve (at start)."""
        async with self._sync_lock:
            try:
                pointers = {
                    name: p["active"]
                    for name, p in self.installer.pointers().items()
                    if p.get("active") and not _same_slot(self._served(name), p["active"])
                }
            except AgentError as exc:
                log.error("cannot read the installed models: %s", exc)
                return
            for name in pointers:
                self.serving.loading(name)
            for name, slot in sorted(pointers.items()):
                await self._serve_slot(name, slot)

    async def _serve_slot(self, name: str, slot: dict) -> None:
        """Load one installed version and serve it.

        A version that cannot load here (no config left, damaged artifact or pointer) is
        rolled back; a busy or memory-starved machine (deadline, worker crash, I/O error)
        is not the version's fault: the load is tried again later.
        """
        from runtime import DeadlineExceeded, RuntimeFailure, WorkerCrashed

        try:
            model = await asyncio.to_thread(self.installer.load, name, slot)
        except (DeadlineExceeded, WorkerCrashed, OSError) as exc:
            log.error("%s v%s did not load (will retry): %s", name, slot.get("version"), exc)
            self.serving.loading(name, False)
            self._spawn(self._retry_load(name, slot["uid"]))
            return
        except (RuntimeFailure, IntegrityFailure, KeyError, ValueError, TypeError) as exc:
            reason = f"v{slot.get('version')} does not load: {one_line(exc)}"
            log.error("%s %s", name, reason)
            self.serving.loading(name, False)
            await self._roll_back_locked(name, reason, slot.get("uid"))
            return
        await asyncio.to_thread(self._activate, name, slot, model)
        if slot.get("probes_pending"):  # the agent stopped before that probe finished
            self._spawn(self._probe_rest(name, slot["uid"]))

    def _activate(self, name: str, slot: dict, model) -> None:
        """Serve a loaded version: a language model by Generate, any other by Infer.

        A model that changes kind between versions leaves the other kind's serving.
        """
        if slot.get("kind") == "llm":
            self.pipelines.drop(name)
            self.serving.drop(name)
            self.llm_serving.put(name, slot, model)
        else:
            self.llm_serving.drop(name)
            self.pipelines.activate(name, slot, model)

    async def _probe_rest(self, name: str, uid: str) -> None:
        """Probe the configs a promoted version skipped, while it serves; record the outcome.

        The version activated on its predecessor's config after one golden check; a
        faster candidate found now takes over between requests (runtime.Model.probe_others),
        and the install pointer records it, so a restart loads it.
        """
        from runtime import RuntimeFailure

        current = self.serving.current(name)
        if current is None or current[0]["uid"] != uid:
            return
        model, stop = current[1], threading.Event()
        try:
            results = await asyncio.to_thread(model.probe_others, stop=stop)
        except (RuntimeFailure, OSError) as exc:  # it serves on: the probe is an extra
            log.warning("%s: probing the other configs failed: %s", name, one_line(exc))
            return
        except asyncio.CancelledError:  # the agent stops: so does the probe, after this one
            stop.set()
            raise
        config = model.config
        if not results or config is None:
            return  # swapped out or failed meanwhile: nothing to record
        async with self._sync_lock:
            if self.installer.record_probes(name, uid, config.key, results):
                log.info(
                    "%s: %d configs probed while serving, on %s", name, len(results), config.key
                )

    def _served(self, name: str) -> dict | None:
        """Return the pointer slot serving `name` now, whatever its kind (None: none)."""
        return self.serving.serving(name) or self.llm_serving.serving(name)

    async def _retry_load(self, name: str, uid: str) -> None:
        await asyncio.sleep(LOAD_RETRY_S)
        async with self._sync_lock:
            slot = (self.installer.pointer(name) or {}).get("active")
            if slot and slot["uid"] == uid and not _same_slot(self._served(name), slot):
                await self._serve_slot(name, slot)

    def _failing(self, name: str, uid: str, reason: str) -> None:
        """Roll `name` back from version `uid` (called from any thread when it fails)."""
        self._loop.call_soon_threadsafe(self._spawn, self._roll_back(name, uid, reason))

    async def _roll_back(self, name: str, uid: str, reason: str) -> None:
        async with self._sync_lock:
            await self._roll_back_locked(name, reason, uid)

    async def _roll_back_locked(self, name: str, reason: str, uid: str | None) -> None:
        current = self.installer.pointer(name).get("active")
        if not current or (uid is not None and current["uid"] != uid):
            log.info("%s: not rolling back, the failing version is no longer active", name)
            return
        previous = self.installer.roll_back(name, reason)
        if previous is None:
            log.error("%s: no previous version to go back to (%s)", name, reason)
            return
        self.queue_installs(
            rollback_reports(name, current, previous, reason, at=self.server_clock.now())
        )
        await self._serve_slot(name, previous)

    async def status(self) -> agent_pb2.StatusResponse:
        """Return what the local API's Status answers.

        The state directory is read off the loop (its files and the lock probe, ~0.5 ms,
        would hold up every other local call and the Watch stream), then the live figures
        on the loop, where they change: the two are read a moment apart.
        """
        body = await asyncio.shield(self._state_read())  # one caller leaving ends no read
        live = {}
        if self.serving is not None:
            live = {**self.llm_serving.status(), **self.serving.status()}
        counts = self.collector.totals()
        msg = agent_pb2.StatusResponse(
            device_id=body["device_id"],
            server=body["server"],
            server_reachable=self.reachable,
            revision=body["revision"],
            last_sync=body["last_sync"] or "",
            last_error=body["last_error"] or "",
            queued_reports=len(self.outbox) if self.outbox is not None else 0,
        )
        for name, m in sorted(body["models"].items()):
            active, previous, failed = m["active"], m["previous"], m["failed"]
            serving = live.get(name, {})
            total = counts.get(name, (0, 0))
            pipeline = self.pipelines.describe(name) if self.pipelines is not None else None
            msg.models.append(
                agent_pb2.ModelStatus(
                    model=name,
                    active_version=active["version"] if active else 0,
                    active_variant=active["variant"] if active else "",
                    previous_version=previous["version"] if previous else 0,
                    config=serving.get("config", ""),
                    serving=bool(serving.get("version")),
                    probes=[
                        agent_pb2.ProbeStatus(
                            config=p.get("config", ""),
                            accepted=bool(p.get("accepted")),
                            p50_us=p.get("p50_us") or 0.0,
                            error=p.get("error") or "",
                        )
                        for p in (active or {}).get("probes") or ()
                    ],
                    failed_version=failed["version"] if failed else 0,
                    failed_reason=failed["reason"] if failed else "",
                    inferences=total[0],
                    errors=total[1],
                    pipeline_triggers=[t["name"] for t in pipeline["triggers"]] if pipeline else [],
                )
            )
        return msg

    def _state_read(self) -> asyncio.Future:
        """Return the read of the state directory under way, or start one.

        In a thread of its own, not the pool inferences and installs share: an app asking
        Status in a loop never waits behind them nor holds them up. Calls that arrive while
        a read is under way share it, so a flood of them costs one read at a time.
        """
        reading = self._status_reading
        if reading is None or reading.done():
            from device_agent import status

            loop = asyncio.get_running_loop()
            reading = loop.run_in_executor(self._status_pool, status.read_status, self.state.path)
            # Read even if every caller left: its error is not "never retrieved".
            reading.add_done_callback(lambda f: f.cancelled() or f.exception())
            self._status_reading = reading
        return reading


def _same_slot(a: dict | None, b: dict) -> bool:
    return bool(a) and (a["uid"], a["artifact"]) == (b["uid"], b["artifact"])
