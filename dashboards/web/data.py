"""The documents the dashboard shows: one function each, shared by its pages and JSON API.

Each returns what the matching CLI command prints with `--json` (the same renderers over
the same messages), so a figure on a page, in `/api/v1/...` and in `skiff ... --json`
is one number read once.
"""

from __future__ import annotations

import collections

from control_plane.api.admin_service import model_pb
from control_plane.api.fleet_convert import backends_pb
from control_plane.api.server import App
from control_plane.cli.fleet_views import backends_dict, device_dict, rollout_dict
from control_plane.cli.views import model_dict
from control_plane.registry.requests import validate_name
from control_plane.rollouts.lifecycle import TRANSITIONS, Action, RolloutState
from control_plane.telemetry import series

# The overview counts every device; past this many platforms the rest are "other", so a
# fleet reporting made-up platforms cannot grow the page (or the metrics) without bound.
MAX_PLATFORMS = 20
OTHER = "other"


def devices(app: App, selector: str = "", limit: int | None = None) -> list[dict]:
    """Return devices as `skiff fleet ls --json` does."""
    records = app.view.list(selector, limit=limit)
    snap = app.view.snapshot()
    return [device_dict(app.view.device_pb(d, snap)) for d in records]


def fleet_summary(app: App) -> dict:
    """Return the fleet overview: devices online and offline, by platform and by version."""
    listed = devices(app)
    by_platform: dict[str, collections.Counter] = {}
    versions: dict[str, collections.Counter] = {}
    for d in listed:
        state = "revoked" if d["revoked"] else "online" if d["online"] else "offline"
        platform = d["attributes"].get("platform", "") or "unknown"
        by_platform.setdefault(platform, collections.Counter())[state] += 1
        if d["revoked"]:
            continue
        for model, s in d["installed"].items():
            versions.setdefault(model, collections.Counter())[f"{s['version']}"] += 1
    platforms = sorted(by_platform, key=lambda p: (-sum(by_platform[p].values()), p))
    if len(platforms) > MAX_PLATFORMS:
        rest = collections.Counter()
        for p in platforms[MAX_PLATFORMS - 1 :]:
            rest.update(by_platform.pop(p))
        platforms = [*platforms[: MAX_PLATFORMS - 1], OTHER]
        by_platform[OTHER] = rest
    total = collections.Counter()
    for counts in by_platform.values():
        total.update(counts)
    return {
        "devices": len(listed),
        "online": total["online"],
        "offline": total["offline"],
        "revoked": total["revoked"],
        "platforms": [
            {"platform": p, **{k: by_platform[p][k] for k in ("online", "offline", "revoked")}}
            for p in platforms
        ],
        "installed": {
            model: dict(sorted(counts.items(), key=lambda kv: int(kv[0])))
            for model, counts in sorted(versions.items())
        },
    }


def models(app: App) -> list[dict]:
    """Return every model as `skiff model ls --json` does."""
    return [model_dict(model_pb(m)) for m in app.registry.list_models()]


def model_versions(app: App, name: str) -> dict:
    """Return a model and its versions' numbers, authors and notes (newest first)."""
    model, records = app.registry.show(name)
    return {
        "model": model_dict(model_pb(model)),
        "versions": [
            {
                "version": v.number,
                "created_at": v.created_at.replace(microsecond=0)
                .isoformat()
                .replace("+00:00", "Z"),
                "created_by": v.created_by,
                "notes": v.notes,
                "variants": [x.name for x in v.variants],
            }
            for v in reversed(records)
        ],
    }


def backends(app: App, name: str, version: int) -> dict:
    """Return a version's backend table as `skiff model show NAME:V --backends --json` does."""
    validate_name(name)
    app.registry.show(name, version)  # NotFound names what is missing
    tables = app.recommendations.table(name, version)
    return {
        "model": name,
        "version": version,
        "classes": [backends_dict(backends_pb(t)) for t in tables],
    }


def version_series(app: App, name: str, version: int, hours: float) -> dict:
    """Return a version's latency and crash series per variant, config and device class."""
    validate_name(name)
    app.registry.show(name, version)
    found = series.version_series(app.store, name, version, hours=hours)
    return {"model": name, "version": version, "hours": hours, "series": _dicts(found)}


def rollouts(app: App, model: str = "") -> list[dict]:
    """Return rollouts as `skiff rollout ls --json` does."""
    if model:
        validate_name(model)
    return [rollout_dict(r) for r in app.ops.list(model)]


def rollout(app: App, rollout_id: str) -> dict:
    """Return one rollout as `skiff rollout show --json` does."""
    return rollout_dict(app.ops.get(rollout_id))


def rollout_series(app: App, rollout_id: str, hours: float) -> dict:
    """Return a rollout's candidate and baseline series."""
    app.rollouts.get(rollout_id)  # NotFound for an unknown id
    found = series.rollout_series(app.store, rollout_id, hours=hours)
    return {"rollout": rollout_id, "hours": hours, "series": _dicts(found)}


def allowed_actions(state: str) -> list[str]:
    """Return the operator actions a rollout in `state` allows (the lifecycle's table)."""
    current = RolloutState(state)
    return [a.value for a in Action if a != Action.ADVANCE and (current, a) in TRANSITIONS]


def _iso(at) -> str:
    return at.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _dicts(found: list[series.Series]) -> list[dict]:
    return [s.to_dict() for s in found]
