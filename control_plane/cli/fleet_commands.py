"""`skiff token`, `skiff fleet` and `skiff rollout`: arguments and what each command does.

Each start_* function returns (json_value, text or a rich renderable), or None.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from contract import errors
from control_plane.api.roles import ROLES
from control_plane.cli.connect import admin_client as _client
from control_plane.cli.listing import add_limit_flag, limit_of, listed, say_more
from control_plane.cli.rollout_watch import POLL_S, Goal, poll_seconds, status_line, wait, watch
from control_plane.fleet.attributes import parse_attr_flags
from control_plane.rollouts.lifecycle import RolloutState, parse_duration, parse_stage_list
from control_plane.settings import Config

Output = tuple[object, object] | None


class _Views:
    """`fleet_views`, imported on first use (it pulls in protobuf and rich)."""

    def __getattr__(self, name: str):
        from control_plane.cli import fleet_views

        return getattr(fleet_views, name)


views = _Views()
TRANSITIONS = ("pause", "resume", "promote", "rollback")
# Recorded as the author of --offline tokens; token names cannot contain spaces, so no
# token can pose as it.
OFFLINE_ACTOR = "token create --offline"


def add_parsers(sub, common: Callable[..., None]) -> None:
    """Add the token, fleet and rollout command groups to the `skiff` parser."""
    token = sub.add_parser("token", help="API tokens for people and scripts; enrollment tokens")
    tsub = token.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = tsub.add_parser(
        "create", help="make an API token (--role) or a device enrollment token (--enroll)"
    )
    common(p)
    kind = p.add_mutually_exclusive_group(required=True)
    kind.add_argument(
        "--role",
        choices=ROLES,
        help="an API token: viewer reads, publisher pushes models, operator drives "
        "rollouts and devices, admin does everything (keys, tokens)",
    )
    kind.add_argument("--enroll", action="store_true", help="a token for devices to enroll with")
    p.add_argument(
        "--ttl",
        default=None,
        help="lifetime, e.g. 30m, 12h, 30d (default: 7d for --enroll, no expiry for --role)",
    )
    p.add_argument("--name", default="", help="a label for the token (unique)")
    p.add_argument("--uses", type=int, default=0, help="--enroll: how many devices (0 = any)")
    p.add_argument(
        "--attr",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--enroll: stamp this attribute on every device that enrolls (repeatable); "
        "stamped attributes are attested: the device cannot change them, `@KEY` clauses match "
        "only them",
    )
    p.add_argument(
        "--offline",
        action="store_true",
        help="--role: write the token straight into the database (--db or the home's), "
        "without a server: how a database without an admin token gets its first one",
    )
    p.add_argument("--db", help="with --offline: the database URL")
    p = tsub.add_parser("ls", help="list API tokens (never their secrets)")
    common(p)
    p.add_argument("--all", action="store_true", help="include revoked and expired tokens")
    p = tsub.add_parser("revoke", help="revoke an API token at once")
    common(p)
    p.add_argument("id", metavar="ID", help="the token's id (tok_...), from `skiff token ls`")

    fleet = sub.add_parser("fleet", help="list, show and revoke devices")
    fsub = fleet.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = fsub.add_parser("ls", help="list devices (those a selector picks)")
    common(p)
    p.add_argument(
        "--select",
        default="",
        metavar="EXPR",
        help="e.g. platform=android,tags=beta; @tags=internal matches attested values only",
    )
    p.add_argument(
        "--fit",
        default="",
        metavar="MODEL:VERSION",
        help="preview device fit: which devices could run that version (see --variant)",
    )
    p.add_argument(
        "--variant",
        default="",
        metavar="NAME",
        help="with --fit: the variant (default: the one a rollout would ship)",
    )
    add_limit_flag(p, "devices, by id")
    p = fsub.add_parser("show", help="show one device")
    common(p)
    p.add_argument("device", metavar="DEVICE", help="its id, or any unique prefix of it")
    p = fsub.add_parser("revoke", help="refuse a device at once, open streams included")
    common(p)
    p.add_argument("device", metavar="DEVICE", help="its id, or any unique prefix of it")
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
    p.add_argument(
        "--halt",
        action="append",
        default=[],
        metavar="RULE",
        help="halt rule, e.g. 'p95_latency_ratio>1.2' or 'crash_rate>0.001' (repeatable)",
    )
    p.add_argument(
        "--min-devices",
        type=int,
        default=50,
        help="devices each cohort needs before a rule passes or fails (default 50)",
    )
    p.add_argument(
        "--min-inferences",
        type=int,
        default=1000,
        help="inferences each cohort needs before a rule passes or fails (default 1000)",
    )
    p.add_argument(
        "--slice-by",
        default="",
        metavar="ATTRIBUTE",
        help="judge rules per value of a device-class attribute (e.g. soc) and roll back "
        "only the failing slice; without it a failing rule pauses the whole rollout",
    )
    p.add_argument(
        "--download-on",
        default="any",
        metavar="wifi|any",
        help="wifi: a device fetches the version only on an unmetered network (Wi-Fi or "
        "wired); until then it keeps what it has and counts as waiting (default any)",
    )
    p.add_argument(
        "--download-while",
        default="any",
        metavar="charging|any",
        help="charging: a device fetches the version only on external power (default any)",
    )
    p.add_argument(
        "--allow-empty",
        action="store_true",
        help="create it even if the selector matches no device today (else refused as a "
        "likely typo)",
    )
    p.add_argument(
        "--allow-degraded",
        action="store_true",
        help="roll out a variant the registry marked degraded (recorded in the audit log)",
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print how many devices it would select per stage (and per slice), creating nothing",
    )
    p = rsub.add_parser("ls", help="list rollouts")
    common(p)
    p.add_argument("--model", default="")
    p = rsub.add_parser("show", help="show a rollout with its counts and audit log")
    common(p)
    p.add_argument("id", metavar="ID", help=ID_HELP)
    p.add_argument(
        "--watch",
        action="store_true",
        help="follow it until it completes or is rolled back (Ctrl-C stops): redrawn on a "
        "terminal, else one line per change (with --json, one JSON document per line)",
    )
    _add_interval_flag(p)
    _add_wait_parser(rsub, common)
    for action in TRANSITIONS:
        p = rsub.add_parser(action, help=f"{action} a rollout")
        common(p)
        p.add_argument("id", metavar="ID", help=ID_HELP)
        p.add_argument("--reason", default="")
        if action in ("resume", "rollback"):
            p.add_argument(
                "--slice",
                default="",
                metavar="ATTRIBUTE=VALUE",
                help=f"{action} one slice of a sliced rollout only (e.g. soc=sm8450)",
            )


ID_HELP = "the rollout's id, or any unique prefix of it"


def _add_wait_parser(rsub, common: Callable[..., None]) -> None:
    p = rsub.add_parser(
        "wait",
        help="wait until a rollout reaches a stage or a state (for scripts)",
        description="Exit 0 once the rollout is there; 7 as soon as it never can be (rolled "
        "back, say); 9 when --timeout passes first; 6 if the control plane stays away.",
    )
    common(p)
    p.add_argument("id", metavar="ID", help=ID_HELP)
    goal = p.add_mutually_exclusive_group()
    goal.add_argument(
        "--stage",
        type=int,
        metavar="N",
        help="until stage N (1 = the first) is in effect, or the rollout completed",
    )
    goal.add_argument(
        "--state",
        choices=[s.value for s in RolloutState],
        help="until the rollout is in this state (default: completed)",
    )
    p.add_argument(
        "--timeout",
        default="0",
        metavar="D",
        help="give up after D, e.g. 90s, 30m, 2h (default 0: wait as long as it takes)",
    )
    _add_interval_flag(p)


def _add_interval_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--interval",
        type=poll_seconds,
        default=POLL_S,
        metavar="S",
        help="seconds between two reads of the rollout",
    )


def start_token_create(*, config: Config, args: argparse.Namespace) -> Output:
    """Make an API token or an enrollment token; prints the secret (shown once)."""
    if args.enroll:
        if args.offline:
            raise errors.InvalidArgument("--offline makes API tokens only (use --role)")
        return _enrollment_token(config, args)
    if args.uses or args.attr:
        raise errors.InvalidArgument("--uses and --attr apply to enrollment tokens (--enroll)")
    if args.db and not args.offline:
        raise errors.InvalidArgument("--db applies to --offline only (online, the server's counts)")
    ttl_s = _ttl(args.ttl) if args.ttl else 0
    if args.offline:
        token, secret = _offline_token(config, role=args.role, name=args.name, ttl_s=ttl_s)
    else:
        with _client(config) as client:
            made = client.create_api_token(role=args.role, name=args.name, ttl_s=ttl_s)
        token, secret = made.token, made.secret
    return {**views.api_token_dict(token), "token": secret}, secret


def _ttl(text: str) -> int:
    """Parse a --ttl, refusing what no token may have before it reaches a message."""
    from control_plane.api.auth import MAX_TOKEN_TTL_S

    ttl_s = parse_duration(text)
    if ttl_s > MAX_TOKEN_TTL_S:
        raise errors.InvalidArgument(f"--ttl {text} is over the 10-year limit")
    return ttl_s


def _offline_token(config: Config, *, role: str, name: str, ttl_s: int):
    """Make a token in the database itself (whoever can write it is admin already)."""
    # Deferred: the server's modules and SQLAlchemy, for this one command only.
    from control_plane.api.admin_service import api_token_pb
    from control_plane.offline_token import create_offline_token

    made, where = create_offline_token(
        config.db, role=role, name=name, ttl_s=ttl_s, actor=OFFLINE_ACTOR
    )
    print(f"skiff: wrote token {made.record.id} into {where}", file=sys.stderr)
    return api_token_pb(made.record), made.secret


def start_token_ls(*, config: Config, args: argparse.Namespace) -> Output:
    """List API tokens."""
    with _client(config) as client:
        tokens = client.list_api_tokens(include_inactive=args.all)
    body = listed("tokens", [views.api_token_dict(t) for t in tokens])
    return body, views.api_tokens_table(tokens)


def start_token_revoke(*, config: Config, args: argparse.Namespace) -> Output:
    """Revoke an API token."""
    with _client(config) as client:
        token = client.revoke_api_token(args.id)
    return views.api_token_dict(token), f"revoked {token.id} ({token.name}, {token.role})"


def _enrollment_token(config: Config, args: argparse.Namespace) -> Output:
    attributes = parse_attr_flags(args.attr)
    with _client(config) as client:
        made = client.create_enrollment_token(
            ttl_s=_ttl(args.ttl or f"{config.enroll_ttl_s}s"),
            uses=args.uses,
            attributes=attributes,
            name=args.name,
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
    fit = None
    if args.fit:
        from control_plane.registry.requests import parse_ref

        model, version = parse_ref(args.fit)
        if version is None:
            raise errors.InvalidArgument(f"--fit {args.fit!r}: give MODEL:VERSION")
        fit = (model, version, args.variant)
    elif args.variant:
        raise errors.InvalidArgument("--variant previews fit: give --fit MODEL:VERSION too")
    with _client(config) as client:
        page = client.devices_page(args.select, limit, fit=fit)
    more = bool(page.next_page_token)
    say_more(more, "devices", limit)
    devices = list(page.devices)
    body = listed("devices", [views.device_dict(d) for d in devices], more=more)
    if fit is None:
        return body, views.devices_table(devices)
    previewed = f"{fit[0]}:{fit[1]} ({page.fit_variant})"
    body["fit"] = views.fit_dict(previewed, devices, page.misfits)
    for item in body["devices"]:
        item["fit"] = views.device_fit(page.misfits.get(item["id"]))
    return body, views.devices_table(devices, misfits=page.misfits, previewed=previewed)


def start_fleet_show(*, config: Config, args: argparse.Namespace) -> Output:
    """Show one device."""
    with _client(config) as client:
        device = client.get_device(args.device)
    return views.device_dict(device, telemetry=True), views.device_text(device)


def start_fleet_revoke(*, config: Config, args: argparse.Namespace) -> Output:
    """Revoke a device."""
    from contract.limits import MAX_REASON, check_text

    check_text("reason", args.reason, MAX_REASON)  # a bad flag first, before any lookup
    with _client(config) as client:
        # Revoked by its full id: a prefix is resolved (and refused when ambiguous) first.
        device = client.revoke_device(client.get_device(args.device).id, args.reason)
    return views.device_dict(device), f"revoked {device.id}"


def start_rollout_create(*, config: Config, args: argparse.Namespace) -> Output:
    """Create a rollout; prints its id."""
    from control_plane.registry.requests import parse_ref
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
        halt=args.halt,
        min_devices=args.min_devices,
        min_inferences=args.min_inferences,
        slice_by=args.slice_by,
        download_on=args.download_on,
        download_while=args.download_while,
        allow_empty=args.allow_empty,
        allow_degraded=args.allow_degraded,
        dry_run=args.dry_run,
    )
    with _client(config) as client:
        rollout = client.create_rollout(request)
    if args.dry_run:
        return views.preview_dict(rollout), views.preview_text(rollout)
    if rollout.degraded:  # on stderr: stdout keeps the id alone, for scripts
        print(
            f"skiff: {rollout.id} rolls out variant {rollout.variant}, DEGRADED "
            f"({rollout.degraded_reason}), with --allow-degraded",
            file=sys.stderr,
        )
    return views.rollout_dict(rollout), rollout.id


def start_rollout_ls(*, config: Config, args: argparse.Namespace) -> Output:
    """List rollouts."""
    with _client(config) as client:
        rollouts = client.list_rollouts(args.model)
    body = listed("rollouts", [views.rollout_dict(r) for r in rollouts])
    return body, views.rollouts_table(rollouts)


def start_rollout_show(*, config: Config, args: argparse.Namespace) -> Output:
    """Show one rollout (with --watch, follow it until it is finished)."""
    with _client(config) as client:
        rollout = client.get_rollout(args.id)
        if args.watch:
            watch(
                lambda: client.get_rollout(rollout.id),
                out=sys.stdout,
                as_json=args.json,
                poll_s=args.interval,
            )
            return None
    return views.rollout_dict(rollout), views.rollout_text(rollout)


def start_rollout_wait(*, config: Config, args: argparse.Namespace) -> Output:
    """Wait until a rollout reaches a stage or a state; prints it as it is then."""
    goal = (
        Goal(stage=args.stage) if args.stage is not None else Goal(state=args.state or "completed")
    )
    timeout_s = parse_duration(args.timeout)
    first = True

    def tell(r) -> None:  # on stderr: stdout holds the result (and --json nothing else)
        nonlocal first
        print(
            f"skiff: {status_line(r)}" + (f"; waiting for {goal}" if first else ""), file=sys.stderr
        )
        first = False

    with _client(config) as client:
        rollout_id = client.get_rollout(args.id).id
        r = wait(
            lambda: client.get_rollout(rollout_id),
            goal,
            timeout_s=timeout_s,
            on_change=tell,
            poll_s=args.interval,
        )
    return views.rollout_dict(r), status_line(r)


def _transition(action: str):
    def start(*, config: Config, args: argparse.Namespace) -> Output:
        with _client(config) as client:
            # A promote names the stage it promotes from: if another operator (or the
            # scheduler) moved the rollout meanwhile, this one is refused, not doubled.
            found = client.get_rollout(args.id)  # a prefix becomes the full id here
            expected = found.stage if action == "promote" else None
            piece = getattr(args, "slice", "")
            r = client.transition_rollout(
                found.id, action, args.reason, expected_stage=expected, slice=piece
            )
        # The same words as `rollout show` and the dashboard (stages numbered from 1).
        return views.rollout_dict(r), views.transition_text(r, action, piece)

    start.__doc__ = f"{action.capitalize()} a rollout."
    return start


start_rollout_pause = _transition("pause")
start_rollout_resume = _transition("resume")
start_rollout_promote = _transition("promote")
start_rollout_rollback = _transition("rollback")
