"""How much a device may report: periods that never overlap, a rate checked on server time.

The server, not the device, decides how much time a report may cover. Per device, a
stats period may not start before the last accepted one ended (no overlaps, no
backdating: `report_periods`), whichever models the batches name; the time it is
credited with runs from the latest of its start and the device's enrollment to the
earliest of its end and the server's receipt. However a device words its periods, then,
they add up to no more than the time since it enrolled, and its inferences (all models
together) to no more than MAX_INFERENCES_PER_S over that time.
"""

from __future__ import annotations

import datetime as dt

from contract import errors
from control_plane.store.report_records import ReportBatch

# More than this many inferences per second of a period is no device's real load:
# refused, so one device cannot outweigh a fleet in the rollups.
MAX_INFERENCES_PER_S = 100_000


# The key a device's periods are kept under: one watermark for all its models, so a
# device cannot multiply its budget by naming more models or splitting them over batches.
EVERY_MODEL = ""


def check_periods(
    batch: ReportBatch,
    enrolled_at: dt.datetime,
    ends: dict[str, dt.datetime],
) -> errors.InvalidArgument | None:
    """Return why `batch` is refused, or None (and move `ends` past it).

    `ends` holds where the device's last accepted stats period ended (under
    EVERY_MODEL); it is moved in place when the batch is accepted, so a group's batches
    are checked in turn. The store calls this inside the transaction that stores the
    batch (`TelemetryStore.add_reports(check=...)`), so replicas cannot both accept one
    period. Batches of install outcomes alone carry no period to check.
    """
    inferences = sum(s.inferences for s in batch.models)
    if not batch.models:
        return None
    start, end = batch.period_start, batch.period_end
    last = ends.get(EVERY_MODEL)
    if last is not None and start < last:
        return errors.InvalidArgument(
            f"period_start {start.isoformat()} is before the end of the last accepted period "
            f"({last.isoformat()}): a device's report periods may not overlap"
        )
    credited = max(0.0, (min(end, batch.received_at) - max(start, enrolled_at)).total_seconds())
    if inferences > int(MAX_INFERENCES_PER_S * credited):
        return errors.InvalidArgument(
            f"{inferences} inferences (all models) in {credited:g} s of server time (from "
            f"{max(start, enrolled_at).isoformat()}) is more than {MAX_INFERENCES_PER_S} a "
            "second"
        )
    ends[EVERY_MODEL] = max(end, last or end)
    return None
