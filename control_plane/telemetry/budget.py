"""How much a device may report: periods that never overlap, a rate checked on server time.

The server, not the device, decides how much time a report may cover. Per device and
model, a stats period may not start before the last accepted one ended (no overlaps, no
backdating: `report_periods`); the time it is credited with runs from the latest of its
start and the device's enrollment to the earliest of its end and the server's receipt.
However a device words its periods, then, they add up to no more than the time since it
enrolled, and its inferences to no more than MAX_INFERENCES_PER_S over that time.
"""

from __future__ import annotations

import datetime as dt

from control_plane import errors
from control_plane.store.telemetry import ReportBatch

# More than this many inferences per second of a period is no device's real load:
# refused, so one device cannot outweigh a fleet in the rollups.
MAX_INFERENCES_PER_S = 100_000


def check_periods(
    batch: ReportBatch,
    enrolled_at: dt.datetime,
    ends: dict[str, dt.datetime],
) -> errors.InvalidArgument | None:
    """Return why `batch` is refused, or None (and move `ends` past it).

    `ends` maps each model to where the device's last accepted period of it ended; it is
    updated in place when the batch is accepted, so a group's batches are checked in turn.
    The store calls this inside the transaction that stores the batch
    (`TelemetryStore.add_reports(check=...)`), so replicas cannot both accept one period.
    """
    totals: dict[str, int] = {}
    for s in batch.models:
        totals[s.model] = totals.get(s.model, 0) + s.inferences
    if not totals:
        return None
    start, end = batch.period_start, batch.period_end
    credited = (min(end, batch.received_at) - max(start, enrolled_at)).total_seconds()
    for model, inferences in sorted(totals.items()):
        last = ends.get(model)
        if last is not None and start < last:
            return errors.InvalidArgument(
                f"model {model!r}: period_start {start.isoformat()} is before the end of the "
                f"last accepted period ({last.isoformat()}): periods may not overlap"
            )
        allowed = int(MAX_INFERENCES_PER_S * max(0.0, credited))
        if inferences > allowed:
            return errors.InvalidArgument(
                f"model {model!r}: {inferences} inferences in {max(0.0, credited):g} s of "
                f"server time (from {max(start, enrolled_at).isoformat()}) is more than "
                f"{MAX_INFERENCES_PER_S} a second"
            )
    for model in totals:
        ends[model] = max(end, ends.get(model, end))
    return None
