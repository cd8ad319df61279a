"""The documents the dashboard shows: one function each, shared by its pages and JSON API.

Each returns what the matching CLI command prints with `--json`: control_plane.views'
documents over the same messages (the dashboard never goes through the CLI), so a figure
on a page, in `/api/v1/...` and in `skiff ... --json` is one number read once.
"""

from __future__ import annotations

import collections

from control_plane import paging
from control_plane.api.admin_service import model_pb, version_pb
from control_plane.api.fleet_convert import backends_pb
from control_plane.app import App
from control_plane.registry import accuracy_bars
from control_plane.registry.requests import validate_name
from control_plane.rollouts.lifecycle import TRANSITIONS, Action, RolloutState, next_step
from control_plane.rollouts.lifecycle import paused_text as lifecycle_paused_text
from control_plane.telemetry import series
from control_plane.views.fleet import backends_dict, device_dict, rollout_dict
from control_plane.views.registry import model_dict, version_dict

# The overview counts every device; past this many platforms the rest are "other", so a
# fleet reporting made-up platforms cannot grow the page (or the metrics) without bound.
MAX_PLATFORMS = 20
OTHER = "other"


def devices(app: App, selector: str = "", limit: int | None = None) -> list[dict]:
    """Return devices as `skiff fleet ls --json` does."""
    return devices_page(app, selector, limit)[0]


def devices_page(
    app: App,
    selector: str = "",
    limit: int | None = None,
    page_token: str = "",
    *,
    telemetry: bool = False,
) -> tuple[list[dict], str]:
    """Return up to `limit` devices (None: all) after `page_token`, and the next token.

    Read page by page through ListDevices' own paging (the same tokens: a token from
    either continues the other), as `skiff fleet ls --limit N` reads them; the token is
    empty when no device is left. With `telemetry`, each also has what `fleet show`
    adds (recent installs, latency per model): the devices page, a page at a time.
    """
    found: list = []
    token = page_token
    while True:
        size = 0 if limit is None else min(limit - len(found), paging.MAX_PAGE_SIZE)
        page, token = app.view.page(selector, size, token)
        found.extend(page)
        if not token or (limit is not None and len(found) >= limit):
            break
    if telemetry:
        found = [app.view.add_telemetry(d) for d in found]
    return [device_dict(d, telemetry=telemetry) for d in found], token


def device(app: App, device_id: str) -> dict:
    """Return one device as `skiff fleet show DEVICE --json` does (any unique id prefix)."""
    record = app.view.get(app.view.fleet.resolve(device_id))
    return device_dict(app.view.device_detail_pb(record), telemetry=True)


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
    since, health = version_health(app, listed)
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
        "health_since": _iso(since),
        "versions": health,
    }


def version_health(app: App, listed: list[dict]) -> tuple:
    """Return (since, rows): per model version, its devices and its last day's figures.

    A row for every version a device is assigned or runs, or that reported in the
    window: devices assigned it (desired) and running it (installed), revoked ones
    left out; its inferences, p95 latency and crash rate fleet-wide since `since`.
    """
    since, figures = series.version_health(app.store)
    counts: dict[tuple[str, int], collections.Counter] = {}
    for d in listed:
        if d["revoked"]:
            continue
        for kind in ("desired", "installed"):
            for model, s in d[kind].items():
                counts.setdefault((model, s["version"]), collections.Counter())[kind] += 1
    rows = []
    for model, number in sorted(set(counts) | set(figures), key=lambda k: (k[0], -k[1])):
        found = figures.get((model, number)) or {}
        rows.append(
            {
                "model": model,
                "version": number,
                "devices_assigned": counts.get((model, number), {}).get("desired", 0),
                "devices_installed": counts.get((model, number), {}).get("installed", 0),
                **{
                    k: found.get(k, 0 if k in ("inferences", "errors", "crashes") else None)
                    for k in ("inferences", "errors", "crashes", "crash_rate", "p50_us", "p95_us")
                },
            }
        )
    return since, rows


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


# What `model show` adds from the CLI's own check of the signed manifest against the keys
# its home pins; the dashboard is the server, whose word that check exists not to take.
CLIENT_TRUST_KEYS = ("signature_verified", "signed_by", "signature_error")


def version_doc(app: App, name: str, number: int) -> dict:
    """Return one version as `skiff model show NAME:V --json` does, less CLIENT_TRUST_KEYS."""
    model, records = app.registry.show(name, number)
    return {
        "model": model_dict(model_pb(model)),
        "versions": [version_dict(version_pb(v)) for v in records],
        "more": False,
    }


def accuracy_checks(variant: dict) -> tuple[accuracy_bars.Bar, ...]:
    """Return the two bars a derived variant was held to at push, as it met or missed them.

    `registry.accuracy_bars`' judgement and words (the push and `model show` say it
    through it too); () for fp32 itself (no figures).
    """
    return accuracy_bars.bars(variant.get("accuracy"))


def degraded_label(variant: dict) -> str:
    """Return what `model show` prints for a degraded variant: the bars it failed."""
    return accuracy_bars.degraded_label(variant.get("accuracy"))


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


def check_action(doc: dict, action: str) -> None:
    """Raise the FailedPrecondition the lifecycle gives `action` on this rollout, if any."""
    next_step(RolloutState(doc["state"]), Action(action), doc["stage"] - 1, len(doc["stages"]))


def paused_text(doc: dict) -> str:
    """Say what a paused rollout does, in the CLI's words (`rollout show`)."""
    return lifecycle_paused_text(doc["stage"] - 1, doc["stages"])


def _iso(at) -> str:
    return at.replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _dicts(found: list[series.Series]) -> list[dict]:
    return [s.to_dict() for s in found]
