"""The dashboard's JSON API: the documents the pages show, as `skiff ... --json` prints them.

GET /api/v1/fleet                              fleet overview (the overview page)
GET /api/v1/devices?select=EXPR&limit=N        = skiff fleet ls --select EXPR --limit N --json
     &page_token=T                             continues where a page ended: a page cut short
                                               has "more": true and its X-Next-Page-Token
                                               header (ListDevices' own tokens)
GET /api/v1/devices/ID                         = skiff fleet show ID --json
GET /api/v1/models                             = skiff model ls --json
GET /api/v1/models/NAME                        a model's versions
GET /api/v1/models/NAME/V                      = skiff model show NAME:V --json, less the CLI's
                                               own signature check (signature_verified, ...)
GET /api/v1/models/NAME/V/backends             = skiff model show NAME:V --backends --json
GET /api/v1/models/NAME/V/series?hours=H       latency and crash series per config and class
GET /api/v1/rollouts?model=NAME                = skiff rollout ls --json
GET /api/v1/rollouts/ID                        = skiff rollout show ID --json
GET /api/v1/rollouts/ID/series?hours=H         candidate and baseline series
POST /api/v1/rollouts/ID/ACTION                = skiff rollout ACTION ID --json
     body {"reason": "", "slice": "", "expected_stage": N}; bearer token, or session + csrf

Lists have the CLI's one shape: {"devices"|"models"|"rollouts": [...], "more": false}.
Scripts authenticate with `Authorization: Bearer skf_...`; the roles are the gRPC API's.
"""

from __future__ import annotations

import flask

from contract import errors
from control_plane.views import listed
from control_plane.views.fleet import rollout_dict
from dashboards.web import data
from dashboards.web.app import caller, sessions, skiff

bp = flask.Blueprint("api", __name__)

_VIEW = {
    "fleet": "/skiff.v1.FleetService/ListDevices",
    "models": "/skiff.v1.AdminService/ListModels",
    "rollouts": "/skiff.v1.RolloutService/ListRollouts",
}
MAX_LIMIT = 100_000
NEXT_PAGE_HEADER = "X-Next-Page-Token"


def _int_arg(name: str, default: int | None, low: int, high: int) -> int | None:
    raw = flask.request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise errors.InvalidArgument(f"{name} must be an integer") from None
    if not low <= value <= high:
        raise errors.InvalidArgument(f"{name} must be {low} to {high}")
    return value


def _hours() -> float:
    raw = flask.request.args.get("hours", "6")
    try:
        return float(raw)
    except ValueError:
        raise errors.InvalidArgument("hours must be a number") from None


@bp.get("/fleet")
def fleet():  # noqa: D103
    caller().require(_VIEW["fleet"])
    return data.fleet_summary(skiff())


@bp.get("/devices")
def devices():  # noqa: D103
    caller().require(_VIEW["fleet"])
    limit = _int_arg("limit", None, 1, MAX_LIMIT)
    args = flask.request.args
    found, token = data.devices_page(
        skiff(), args.get("select", ""), limit, args.get("page_token", "")
    )
    response = flask.jsonify(listed("devices", found, more=bool(token)))
    if token:
        response.headers[NEXT_PAGE_HEADER] = token
    return response


@bp.get("/devices/<device_id>")
def device(device_id: str):  # noqa: D103
    caller().require("/skiff.v1.FleetService/GetDevice")
    return data.device(skiff(), device_id)


@bp.get("/models")
def models():  # noqa: D103
    caller().require(_VIEW["models"])
    return listed("models", data.models(skiff()))


@bp.get("/models/<name>")
def model(name: str):  # noqa: D103
    caller().require(_VIEW["models"])
    return data.model_versions(skiff(), name)


@bp.get("/models/<name>/<int:version>")
def version(name: str, version: int):  # noqa: D103
    caller().require("/skiff.v1.AdminService/GetModel")
    return data.version_doc(skiff(), name, version)


@bp.get("/models/<name>/<int:version>/backends")
def backends(name: str, version: int):  # noqa: D103
    caller().require("/skiff.v1.FleetService/GetBackends")
    return data.backends(skiff(), name, version)


@bp.get("/models/<name>/<int:version>/series")
def version_series(name: str, version: int):  # noqa: D103
    caller().require("/skiff.v1.FleetService/GetBackends")
    return data.version_series(skiff(), name, version, _hours())


@bp.get("/rollouts")
def rollouts():  # noqa: D103
    caller().require(_VIEW["rollouts"])
    return listed("rollouts", data.rollouts(skiff(), flask.request.args.get("model", "")))


@bp.get("/rollouts/<rollout_id>")
def rollout(rollout_id: str):  # noqa: D103
    caller().require("/skiff.v1.RolloutService/GetRollout")
    return data.rollout(skiff(), rollout_id)


@bp.get("/rollouts/<rollout_id>/series")
def rollout_series(rollout_id: str):  # noqa: D103
    caller().require("/skiff.v1.RolloutService/GetRollout")
    return data.rollout_series(skiff(), rollout_id, _hours())


@bp.post("/rollouts/<rollout_id>/<action>")
def transition(rollout_id: str, action: str):  # noqa: D103
    who = caller()
    if who.session_secret:  # a browser session: the cookie alone proves nothing
        sessions().check_csrf(who, flask.request.headers.get("X-CSRF-Token"))
    who.require("/skiff.v1.RolloutService/TransitionRollout")
    body = flask.request.get_json(silent=True)
    if body is None:
        body = {}
    if not isinstance(body, dict):
        raise errors.InvalidArgument("the body must be a JSON object")
    expected = body.get("expected_stage")
    if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool)):
        raise errors.InvalidArgument("expected_stage must be an integer")
    reason, piece = body.get("reason", ""), body.get("slice", "")
    if not isinstance(reason, str) or not isinstance(piece, str):
        raise errors.InvalidArgument("reason and slice must be strings")
    record = skiff().ops.transition(
        rollout_id,
        action,
        actor=who.token.name,
        reason=reason,
        expected_stage=expected,
        slice=piece,
    )
    return rollout_dict(record)
