"""`skiff sim`: arguments in, a simulated fleet run against a real control plane, summary out.

The run: reuse the identities in `--state` (up to N), enroll the rest (with
`--enroll-token`, or a token made through the admin token), Sync and install once, then
(unless `--once`) hold every Watch stream for `--duration` or until Ctrl-C. Whatever
ends it, streams are cancelled, channels closed and the summary returned.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from contract import errors
from contract.transport import ClientTls
from control_plane.api.transport import client_tls
from control_plane.rollouts.lifecycle import parse_duration
from control_plane.settings import Config
from control_plane.sim.display import LiveView, live_console, render, summary_json
from control_plane.sim.fleet import FleetSimulator
from control_plane.sim.profile import Profile, load_profile
from control_plane.sim.state import Identity, load_state, save_state

MAX_DEVICES = 1_000_000
TOKEN_TTL_S = 3600


@dataclass(frozen=True)
class Plan:
    """One simulator run, resolved from the command line."""

    address: str
    tls: ClientTls
    devices: int
    profile: Profile
    seed: int
    token: str
    state_path: Path | None
    state: tuple[Identity, ...]
    once: bool
    duration_s: int | None
    report_interval_s: int = 0
    live: bool = False  # draw progress on stderr (a terminal, without --json)


def run_sim(*, config: Config, args: argparse.Namespace) -> tuple[dict, object]:
    """Run `skiff sim`; returns (the JSON document, the text summary)."""
    if not 0 <= args.devices <= MAX_DEVICES:
        raise errors.InvalidArgument(f"--devices must be from 0 to {MAX_DEVICES}")
    duration = parse_duration(args.duration) if args.duration else None
    profile = load_profile(args.profile)
    address = args.server or config.dial_address
    state = tuple(load_state(args.state)) if args.state else ()
    missing = args.devices - min(len(state), args.devices)
    plan = Plan(
        address=address,
        tls=client_tls(config),
        devices=args.devices,
        profile=profile,
        seed=args.seed,
        token=args.enroll_token or (_make_token(config, address, missing) if missing else ""),
        state_path=args.state,
        state=state,
        once=args.once,
        duration_s=duration,
        report_interval_s=parse_duration(args.report_interval),
        live=live_console(as_json=args.json) is not None,
    )
    _raise_fd_limit()
    return asyncio.run(_run(plan))


def _make_token(config: Config, address: str, uses: int) -> str:
    from control_plane.api.client import AdminClient
    from control_plane.home import read_token

    with AdminClient(address, read_token(config.home), client_tls(config)) as client:
        made = client.create_enrollment_token(ttl_s=TOKEN_TTL_S, uses=uses, name="skiff-sim")
    return made.token


def _raise_fd_limit() -> None:
    # One descriptor per channel is small, but the run may share a process with servers.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def _run(plan: Plan) -> tuple[dict, object]:
    started = time.monotonic()
    async with FleetSimulator(
        [plan.address], profile=plan.profile, seed=plan.seed, tls=plan.tls
    ) as sim:
        await _until_done_or_stopped(sim, plan)
        if plan.report_interval_s:  # what is queued gets a few seconds, as agents give it
            await sim.stop_reporting()
        # Counted before the streams close, so `watching` says how many were up.
        return _report(sim, plan, time.monotonic() - started)


async def _until_done_or_stopped(sim: FleetSimulator, plan: Plan) -> None:
    """Run the plan, drawing progress, until it ends, fails or a signal stops it."""
    stop = asyncio.Event()
    console = live_console(as_json=False) if plan.live else None
    view = LiveView(sim.stats, f"skiff sim -> {plan.address}", console)
    drawing = asyncio.create_task(view.run())
    work = asyncio.create_task(_drive(sim, plan))
    with _stop_on_signals(stop):
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    for task in (work, stopper, drawing):
        task.cancel()
    await asyncio.gather(stopper, drawing, return_exceptions=True)
    with contextlib.suppress(asyncio.CancelledError):
        await work  # re-raises what went wrong; a stopped run still reports


def _report(sim: FleetSimulator, plan: Plan, elapsed_s: float) -> tuple[dict, object]:
    stats = sim.stats()
    reused = min(len(plan.state), plan.devices)
    summary = summary_json(
        stats, elapsed_s=elapsed_s, enrolled=stats.devices - reused, reused=reused
    )
    doc = {"devices": [d.to_json() for d in sim.devices], "summary": summary}
    return doc, render(stats, title=f"skiff sim: {plan.address}, {elapsed_s:.1f}s")


async def _drive(sim: FleetSimulator, plan: Plan) -> None:
    reused = sim.adopt(plan.state[: plan.devices])
    try:
        await sim.enroll(plan.devices - len(reused), plan.token)
    finally:
        if plan.state_path is not None:
            kept = [d.identity for d in sim.devices] + list(plan.state[plan.devices :])
            save_state(plan.state_path, plan.address, kept)
    await sim.sync_all()
    if reused and all(d.rejected for d in reused):
        raise errors.Unauthenticated(
            f"the control plane at {plan.address} refused every device in {plan.state_path} "
            "(enrolled with another control plane?)"
        )
    if plan.once:
        return
    sim.watch_all()
    if plan.report_interval_s:
        sim.report_all(plan.report_interval_s)
    if plan.duration_s is None:
        await asyncio.Event().wait()  # until Ctrl-C or SIGTERM
    await asyncio.sleep(plan.duration_s)


@contextlib.contextmanager
def _stop_on_signals(stop: asyncio.Event) -> Iterator[None]:
    """Turn SIGINT/SIGTERM into `stop` so the run ends with a summary, not a traceback."""
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
        except (RuntimeError, ValueError, NotImplementedError):
            pass  # not the main thread: the caller stops us by cancelling instead
    try:
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
