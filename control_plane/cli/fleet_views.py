"""JSON and table renderings of devices, rollouts and API tokens for the CLI."""

from __future__ import annotations

from rich.table import Table

from protos import fleet_pb2


def _ts(ts) -> str | None:
    if not ts.seconds and not ts.nanos:
        return None
    return ts.ToDatetime().replace(microsecond=0).isoformat() + "Z"


def attributes_dict(msg) -> dict:
    """Return the canonical attribute dict of a DeviceAttributes message."""
    out: dict = {}
    for key in ("platform", "os_version", "app_version", "device_model", "soc", "region"):
        if getattr(msg, key):
            out[key] = getattr(msg, key)
    if msg.ram_mb:
        out["ram_mb"] = msg.ram_mb
    if msg.tags:
        out["tags"] = sorted(msg.tags)
    if msg.custom:
        out["custom"] = dict(sorted(msg.custom.items()))
    return out


def _states(items) -> dict:
    return {s.model: {"version": s.version, "variant": s.variant} for s in items}


def device_dict(d: fleet_pb2.Device) -> dict:
    """JSON-ready form of a device (the shape `skiff sim --json` prints too)."""
    return {
        "id": d.id,
        "attributes": attributes_dict(d.attributes),
        "enrolled_at": _ts(d.enrolled_at),
        "last_seen": _ts(d.last_seen),
        "online": d.online,
        "revoked": d.revoked,
        "installed": _states(d.installed),
        "synced": _states(d.synced),
        "desired": {
            m: {"version": x.version, "variant": x.variant, "rollout": x.rollout}
            for m, x in sorted(d.desired.items())
        },
    }


def _models(states: dict) -> str:
    return ", ".join(f"{m}:{s['version']}" for m, s in states.items()) or "-"


def devices_table(devices: list[fleet_pb2.Device]) -> Table | str:
    """Render devices as a table."""
    if not devices:
        return "no devices match"
    table = Table(box=None, header_style="bold")
    for col in ("ID", "PLATFORM", "MODEL", "SOC", "REGION", "ONLINE", "DESIRED", "INSTALLED"):
        table.add_column(col)
    for d in devices:
        body = device_dict(d)
        a = body["attributes"]
        table.add_row(
            d.id,
            a.get("platform", "-"),
            a.get("device_model", "-"),
            a.get("soc", "-"),
            a.get("region", "-"),
            "revoked" if d.revoked else ("yes" if d.online else "no"),
            _models(body["desired"]),
            _models(body["installed"]),
        )
    return table


def device_text(d: fleet_pb2.Device) -> str:
    """Describe one device for people."""
    body = device_dict(d)
    attrs = ", ".join(f"{k}={v}" for k, v in body["attributes"].items())
    lines = [
        d.id + ("  (revoked)" if d.revoked else ""),
        f"  attributes  {attrs or '-'}",
        f"  enrolled    {body['enrolled_at']}",
        f"  last seen   {body['last_seen'] or '-'}  online: {'yes' if d.online else 'no'}",
        f"  desired     {_desired_text(body['desired'])}",
        f"  synced      {_models(body['synced'])}",
        f"  installed   {_models(body['installed'])}",
    ]
    return "\n".join(lines)


def _desired_text(desired: dict) -> str:
    parts = [f"{m}:{x['version']} ({x['variant']}, {x['rollout']})" for m, x in desired.items()]
    return ", ".join(parts) or "-"


def rollout_dict(r: fleet_pb2.Rollout) -> dict:
    """JSON-ready form of a rollout."""
    return {
        "id": r.id,
        "model": r.model,
        "version": r.version,
        "variant": r.variant,
        "selector": r.selector,
        "stages": [float(s) for s in r.stages],
        "stage": r.stage,
        "state": r.state,
        "bake_s": r.bake_s,
        "priority": r.priority,
        "created_at": _ts(r.created_at),
        "created_by": r.created_by,
        "stage_started_at": _ts(r.stage_started_at),
        "audit": [
            {
                "at": _ts(e.at),
                "actor": e.actor,
                "action": e.action,
                "from_state": e.from_state,
                "to_state": e.to_state,
                "stage": e.stage,
                "reason": e.reason,
            }
            for e in r.audit
        ],
        "counts": {
            "selected": r.counts.selected,
            "in_stage": r.counts.in_stage,
            "synced": r.counts.synced,
            "installed": r.counts.installed,
        },
    }


def _stages(r: fleet_pb2.Rollout) -> str:
    return " ".join((f"[{s:g}%]" if i == r.stage else f"{s:g}%") for i, s in enumerate(r.stages))


def rollouts_table(rollouts: list[fleet_pb2.Rollout]) -> Table | str:
    """Render rollouts as a table."""
    if not rollouts:
        return "no rollouts yet: create one with `skiff rollout create NAME:VERSION`"
    table = Table(box=None, header_style="bold")
    for col in ("ID", "MODEL", "VARIANT", "STATE", "STAGES", "PRIORITY", "SELECTOR"):
        table.add_column(col)
    for r in rollouts:
        table.add_row(
            r.id,
            f"{r.model}:{r.version}",
            r.variant,
            r.state,
            _stages(r),
            str(r.priority),
            r.selector or "(whole fleet)",
        )
    return table


def rollout_text(r: fleet_pb2.Rollout) -> str:
    """Describe one rollout for people, with its counts and audit log."""
    c = r.counts
    lines = [
        f"{r.id}  {r.model}:{r.version} ({r.variant})  {r.state}",
        f"  selector  {r.selector or '(whole fleet)'}",
        f"  stages    {_stages(r)}  bake {r.bake_s}s  priority {r.priority}",
        f"  devices   selected {c.selected}  in stage {c.in_stage}  synced {c.synced}"
        f"  installed {c.installed}",
        "  audit",
    ]
    for e in r.audit:
        change = f"{e.from_state} -> {e.to_state}" if e.from_state else e.to_state
        why = f"  ({e.reason})" if e.reason else ""
        lines.append(f"    {_ts(e.at)}  {e.actor:<10} {e.action:<8} {change}, stage {e.stage}{why}")
    return "\n".join(lines)


def api_token_dict(t) -> dict:
    """JSON-ready form of an API token (its id and metadata; never a secret)."""
    return {
        "id": t.id,
        "name": t.name,
        "role": t.role,
        "created_at": _ts(t.created_at),
        "created_by": t.created_by,
        "expires_at": _ts(t.expires_at),
        "revoked_at": _ts(t.revoked_at),
    }


def api_tokens_table(tokens) -> Table | str:
    """Render API tokens as a table."""
    if not tokens:
        return "no API tokens"
    table = Table(box=None, header_style="bold")
    for col in ("ID", "NAME", "ROLE", "CREATED", "BY", "EXPIRES", "REVOKED"):
        # Ids are what `token revoke` takes: never cut them to fit a narrow terminal.
        table.add_column(col, no_wrap=col == "ID", min_width=16 if col == "ID" else None)
    for t in tokens:
        table.add_row(
            t.id,
            t.name,
            t.role,
            _minute(t.created_at),
            t.created_by or "-",
            _minute(t.expires_at) or "never",
            _minute(t.revoked_at) or "-",
        )
    return table


def _minute(ts) -> str | None:
    if not ts.seconds and not ts.nanos:
        return None
    return ts.ToDatetime().strftime("%Y-%m-%d %H:%M")
