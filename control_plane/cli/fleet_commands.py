"""`skiff token`, `skiff fleet` and `skiff rollout`: arguments and what each command does.

Each start_* function returns (json_value, text or a rich renderable), or None.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

from control_plane import errors
from control_plane.cli.listing import add_limit_flag, limit_of, say_more
from control_plane.fleet.attributes import parse_attr_flags
from control_plane.rollouts.lifecycle import parse_duration, parse_stage_list
from control_plane.settings import Config

Output = tuple[object, object] | None


class _Views:
    """`fleet_views`, imported on first use (it pulls in protobuf and rich)."""

    def __getattr__(self, name: str):
        from control_plane.cli import fleet_views

        return getattr(fleet_views, name)


views = _Views()
TRANSITIONS = ("pause", "resume", "promote", "rollback")


def add_parsers(sub, common: Callable[..., None]) -> None:
    """Add the token, fleet and rollout command groups to the `skiff` parser."""
    token = sub.add_parser("token", help="make tokens (enrollment tokens for devices)")
    tsub = token.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = tsub.add_parser("create", help="make a token (--enroll: for devices to enroll with)")
    common(p)
    p.add_argument("--enroll", action="store_true", required=True, help="an enrollment token")
    p.add_argument("--ttl", default="7d", help="lifetime, e.g. 30m, 12h, 7d (default 7d)")
    p.add_argument("--uses", type=int, default=0, help="how many devices may enroll (0 = any)")
    p.add_argument(
        "--attr",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="stamp this attribute on every device that enrolls (repeatable)",
    )
    p.add_argument("--name", default="", help="a label for the token")

    fleet = sub.add_parser("fleet", help="list, show and revoke devices")
    fsub = fleet.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = fsub.add_parser("ls", help="list devices (those a selector picks)")
    common(p)
    p.add_argument("--select", default="", metavar="EXPR", help="e.g. platform=android,tags=beta")
    add_limit_flag(p, "devices, by id")
    p = fsub.add_parser("show", help="show one device")
    common(p)
    p.add_argument("device")
    p = fsub.add_parser("revoke", help="refuse a device at once, open streams included")
    common(p)
    p.add_argument("device")
    p.add_argument("--reason", default="")

    rollout = sub.add_parser("rollout", help="create and drive staged rollouts")
    rsub = rollout.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = rsub.add_parser("create", help="roll a version out to the devices a selector picks")
    common(p)
    p.add_argument("ref", metavar="NAME:VERSION")
    p.add_argument("--variant", default="", help="default fp32")
    p.add_argument("--select", default="", metavar="EXPR", help="default: the whole fleet")
    p.add_argument("--stages", default="100", help="percentages, e.g. 1,10,50,100")
    p.add_argument(
        "--bake",
        default="0",
        help="time per stage before it advances by itself, e.g. 10m (0: only on promote)",
    )
    p.add_argument("--priority", type=int, default=0)
    p.add_argument("--reason", default="")
    p = rsub.add_parser("ls", help="list rollouts")
    common(p)
    p.add_argument("--model", default="")
    p = rsub.add_parser("show", help="show a rollout with its counts and audit log")
    common(p)
    p.add_argument("id")
    for action in TRANSITIONS:
        p = rsub.add_parser(action, help=f"{action} a rollout")
        common(p)
        p.add_argument("id")
        p.add_argument("--reason", default="")


def _client(config: Config):
    from control_plane.api.client import AdminClient  # deferred: keeps `skiff --help` instant
    from control_plane.home import read_token

    return AdminClient(config.dial_address, read_token(config.home))


def start_token_create(*, config: Config, args: argparse.Namespace) -> Output:
    """Make an enrollment token."""
    attributes = parse_attr_flags(args.attr)
    with _client(config) as client:
        made = client.create_enrollment_token(
            ttl_s=parse_duration(args.ttl), uses=args.uses, attributes=attributes, name=args.name
        )
    body = {
        "token": made.token,
        "id": made.id,
        "expires_at": made.expires_at.ToDatetime().isoformat() + "Z",
        "uses": made.uses or None,
        "attributes": attributes,
    }
    return body, made.token


def start_fleet_ls(*, config: Config, args: argparse.Namespace) -> Output:
    """List devices (all those the selector picks, page by page, unless --limit)."""
    limit = limit_of(args)
    with _client(config) as client:
        page = client.devices_page(args.select, limit)
    say_more(bool(page.next_page_token), "devices", limit)
    devices = list(page.devices)
    return [views.device_dict(d) for d in devices], views.devices_table(devices)


def start_fleet_show(*, config: Config, args: argparse.Namespace) -> Output:
    """Show one device."""
    with _client(config) as client:
        device = client.get_device(args.device)
    return views.device_dict(device), views.device_text(device)


def start_fleet_revoke(*, config: Config, args: argparse.Namespace) -> Output:
    """Revoke a device."""
    with _client(config) as client:
        device = client.revoke_device(args.device, args.reason)
    return views.device_dict(device), f"revoked {device.id}"


def start_rollout_create(*, config: Config, args: argparse.Namespace) -> Output:
    """Create a rollout; prints its id."""
    from control_plane.registry.registry import parse_ref
    from protos import fleet_pb2

    name, version = parse_ref(args.ref)
    if version is None:
        raise errors.InvalidArgument(f"name the version to roll out: {name}:N")
    request = fleet_pb2.CreateRolloutRequest(
        model=name,
        version=version,
        variant=args.variant,
        selector=args.select,
        stages=parse_stage_list(args.stages),
        bake_s=parse_duration(args.bake),
        priority=args.priority,
        reason=args.reason,
    )
    with _client(config) as client:
        rollout = client.create_rollout(request)
    return views.rollout_dict(rollout), rollout.id


def start_rollout_ls(*, config: Config, args: argparse.Namespace) -> Output:
    """List rollouts."""
    with _client(config) as client:
        rollouts = client.list_rollouts(args.model)
    return [views.rollout_dict(r) for r in rollouts], views.rollouts_table(rollouts)


def start_rollout_show(*, config: Config, args: argparse.Namespace) -> Output:
    """Show one rollout."""
    with _client(config) as client:
        rollout = client.get_rollout(args.id)
    return views.rollout_dict(rollout), views.rollout_text(rollout)


def _transition(action: str):
    def start(*, config: Config, args: argparse.Namespace) -> Output:
        with _client(config) as client:
            # A promote names the stage it promotes from: if another operator (or the
            # scheduler) moved the rollout meanwhile, this one is refused, not doubled.
            expected = client.get_rollout(args.id).stage if action == "promote" else None
            r = client.transition_rollout(args.id, action, args.reason, expected_stage=expected)
        stage = f"stage {r.stage + 1}/{len(r.stages)} ({r.stages[r.stage]:g}%)"
        return views.rollout_dict(r), f"{r.id}: {r.state}, {stage}"

    start.__doc__ = f"{action.capitalize()} a rollout."
    return start


start_rollout_pause = _transition("pause")
start_rollout_resume = _transition("resume")
start_rollout_promote = _transition("promote")
start_rollout_rollback = _transition("rollback")
