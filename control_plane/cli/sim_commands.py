"""`skiff sim`: a fleet of simulated devices, real gRPC clients of a real control plane."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from control_plane.settings import Config

Output = tuple[object, object] | None


def add_parsers(sub, common: Callable[..., None]) -> None:
    """Add `skiff sim` to the `skiff` parser."""
    p = sub.add_parser(
        "sim",
        help="simulate a fleet of devices against a control plane",
        description="On a terminal, progress is redrawn on stderr as the fleet enrolls, syncs "
        "and installs; piped or with --json, only the summary is printed at the end.",
    )
    common(p)
    p.add_argument(
        "--server", default="", metavar="ADDR", help="control plane HOST:PORT (default: the home's)"
    )
    p.add_argument("--devices", type=int, required=True, metavar="N", help="how many devices")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSON device mix or list (default: control_plane/sim/default_profile.json)",
    )
    p.add_argument("--seed", type=int, default=0, help="draws the devices' attributes")
    p.add_argument(
        "--enroll-token",
        default="",
        metavar="T",
        help="enroll with this token (default: one made with the home's admin token)",
    )
    p.add_argument(
        "--state", type=Path, default=None, metavar="FILE", help="keep identities in FILE"
    )
    p.add_argument(
        "--report-interval",
        default="60s",
        metavar="D",
        help="devices report serving stats this often, as agents do (0: never; default 60s)",
    )
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "--duration",
        default="",
        metavar="D",
        help="run for D, e.g. 60s, 10m (default: until Ctrl-C)",
    )
    group.add_argument("--once", action="store_true", help="enroll, sync once, exit")


def start_sim(*, config: Config, args: argparse.Namespace) -> Output:
    """Run the simulator."""
    from control_plane.sim.runner import run_sim  # deferred: keeps `skiff --help` instant

    return run_sim(config=config, args=args)
