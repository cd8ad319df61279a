"""What the simulator shows: a live convergence table on stderr, and the final summary.

The live view is for people at a terminal only: `skiff sim` draws it when stderr is one
and `--json` is not given, so a pipe, a log file or a script reads the summary alone.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from control_plane.sim.stats import FleetStats


def _label(target: tuple[str, int, str]) -> str:
    model, version, variant = target
    return f"{model}:{version} ({variant})"


def summary_json(stats: FleetStats, *, elapsed_s: float, enrolled: int, reused: int) -> dict:
    """Return the `summary` object of `skiff sim --json`."""
    return {
        "devices": stats.devices,
        "enrolled": enrolled,
        "reused": reused,
        "watching": stats.watching,
        "synced": stats.synced,
        "converged_devices": stats.converged,
        "rejected": stats.rejected,
        "syncs": stats.syncs,
        "reconnects": stats.reconnects,
        "downloads": stats.downloads,
        "bytes_downloaded": stats.bytes_downloaded,
        "reports": stats.reports,
        "reports_queued": stats.reports_queued,
        "reports_dropped": stats.reports_dropped,
        "failures": dict(sorted(stats.failures.items())),
        "converged": {
            _label(t): {"desired": c.desired, "installed": c.installed}
            for t, c in stats.targets.items()
        },
        "elapsed_s": round(elapsed_s, 3),
    }


def render(stats: FleetStats, *, title: str) -> Group:
    """Return the fleet's state as a headline and one row per desired version."""
    head = Text.assemble(
        (title, "bold"),
        f"\ndevices {stats.devices}  watching {stats.watching}  synced {stats.synced}"
        f"  converged {stats.converged}  rejected {stats.rejected}  syncs {stats.syncs}"
        f"  reconnects {stats.reconnects}",
    )
    if stats.enrolling:
        head.append(f"\nenrolling: {stats.enrolling:,} devices to go")
    if stats.failures:
        failures = ", ".join(f"{k} {n}" for k, n in sorted(stats.failures.items()))
        head.append(f"\nfailed calls: {failures}", style="yellow")
    if not stats.targets:
        return Group(head, Text("no device has a desired version yet"))
    table = Table(box=None, header_style="bold")
    for column in ("DESIRED VERSION", "DEVICES", "INSTALLED", "CONVERGED"):
        table.add_column(column, justify="left" if column == "DESIRED VERSION" else "right")
    for target, count in stats.targets.items():
        share = count.installed / count.desired if count.desired else 1.0
        table.add_row(_label(target), str(count.desired), str(count.installed), f"{share:.0%}")
    return Group(head, table)


def live_console(*, as_json: bool) -> Console | None:
    """Return the console to draw the live view on: stderr at a terminal, never for --json."""
    if as_json or not sys.stderr.isatty():
        return None
    return Console(file=sys.stderr, highlight=False)


class LiveView:
    """Redraws the fleet's state on `console` a few times a second (None: draws nothing).

    Drawn from the event loop, not rich's refresh thread: the counters it reads are
    mutated by the loop, and a dict must not change size while another thread iterates.
    """

    def __init__(
        self, stats: Callable[[], FleetStats], title: str, console: Console | None
    ) -> None:
        self._stats, self._title = stats, title
        self._started = time.monotonic()
        self._live = None if console is None else Live(console=console, auto_refresh=False)

    async def run(self, interval_s: float = 0.25) -> None:
        """Redraw until cancelled."""
        if self._live is None:
            return
        self._live.start()
        try:
            while True:
                self.refresh()
                await asyncio.sleep(interval_s)
        finally:
            self.refresh()
            self._live.stop()

    def refresh(self) -> None:
        """Draw the current state once."""
        if self._live is not None:
            elapsed = time.monotonic() - self._started
            title = f"{self._title}  {elapsed:,.0f}s"
            self._live.update(render(self._stats(), title=title), refresh=True)
