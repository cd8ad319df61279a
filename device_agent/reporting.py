"""Telemetry on its way out: install outcomes at once, serving stats every interval.

Batches go through the on-disk outbox (device_agent.report_outbox.Outbox) first, so nothing
is lost while the control plane is unreachable: `flush` sends them oldest first and
acknowledges each once the control plane took it (a batch id is applied once even when
sent twice). A batch the control plane refuses as invalid would never be accepted: it is
dropped (counted) rather than left to block the queue.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Awaitable, Callable

import grpc

from contract.device_client import DeviceCallError
from contract.report_batches import FLUSH_ON_STOP_S
from device_agent.report_outbox import Collector, Outbox, install_batch
from protos import device_pb2

log = logging.getLogger("skiff.agent")

AUTH_CODES = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
# On SIGTERM: how long queued reports may take to reach the control plane.


class Reporter:
    """Queue and send one agent's telemetry."""

    def __init__(
        self,
        outbox: Outbox,
        collector: Collector,
        send: Callable[[device_pb2.ReportRequest], Awaitable[object]],
        *,
        interval_s: float,
        collect_events: Callable[[], None] | None = None,
        reached: Callable[[bool], None] = lambda ok: None,
    ) -> None:
        """Queue into `outbox`, send with `send` (which raises DeviceCallError).

        `collect_events` pulls the runtime's crash and fallback events into `collector`
        before each cut; `reached` hears whether the control plane answered (not called
        for an auth refusal).
        """
        self.outbox, self.collector = outbox, collector
        self.interval_s = interval_s
        self._send, self._collect_events, self._reached = send, collect_events, reached
        self._now = asyncio.Event()
        # This run's first period must not overlap the last one queued (and sent) before.
        collector.resume_after(outbox.period_end)

    def queue_installs(self, reports: list[device_pb2.InstallReport]) -> None:
        """Queue install outcomes and send them soon."""
        if not reports:
            return
        try:
            self.outbox.put(install_batch(reports, self.collector.clock))
        except (OSError, sqlite3.Error) as exc:
            log.warning("cannot queue install reports: %s", exc)
            return
        self._now.set()

    def cut(self) -> None:
        """Queue the serving stats gathered since the last cut."""
        if self._collect_events is not None:
            self._collect_events()
        batch = self.collector.cut()
        if batch is not None:
            try:
                self.outbox.put(batch)
            except (OSError, sqlite3.Error) as exc:
                log.warning("cannot queue a telemetry batch: %s", exc)

    async def flush(self) -> int:
        """Send queued batches, oldest first; return how many the control plane took."""
        sent = 0
        while pending := self.outbox.pending(limit=20):
            for batch in pending:
                try:
                    await self._send(batch)
                except DeviceCallError as exc:
                    if exc.code != grpc.StatusCode.INVALID_ARGUMENT:
                        if exc.code not in AUTH_CODES:
                            self._reached(False)
                        log.info("reports wait for the control plane: %s", exc.message)
                        return sent
                    log.error("control plane refused a telemetry batch: %s", exc.message)
                    self.outbox.discard(batch)
                    continue
                sent += 1
                self._reached(True)
                self.outbox.ack(batch)
        return sent

    async def loop(self) -> None:
        """Cut every interval, send whenever there is something; never raises."""
        while True:
            try:
                # Not wait_for: on 3.11 it can swallow a cancel that lands as the event is
                # set, and the agent's stop would then wait for this loop for ever.
                async with asyncio.timeout(self.interval_s):
                    await self._now.wait()
            except TimeoutError:
                self.cut()
            self._now.clear()
            try:
                await self.flush()
            except Exception as exc:  # noqa: BLE001 - reporting never stops the agent
                log.error("reporting failed: %s: %s", type(exc).__name__, exc)

    async def final(self) -> None:
        """Cut and send what is left, for at most FLUSH_ON_STOP_S (the agent is stopping)."""
        self.cut()
        try:
            await asyncio.wait_for(self.flush(), FLUSH_ON_STOP_S)
        except (TimeoutError, DeviceCallError, OSError, sqlite3.Error):
            log.info("reports left queued for the next start")
