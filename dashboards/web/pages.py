"""The dashboard's pages: overview, devices, models, versions, rollouts, login and actions.

Each page renders a document from `data` (the JSON API's); an action posts a form with
the session's CSRF value and the state the operator saw, and goes through RolloutOps,
the code `skiff rollout pause|resume|promote|rollback` reaches through gRPC.
"""

from __future__ import annotations

import re

import flask

from contract import errors
from control_plane import paging
from control_plane.api.throttle import Throttled
from dashboards.web import data
from dashboards.web.app import (
    attempt,
    caller,
    retry_after,
    sessions,
    set_session_cookie,
    skiff,
    status_of,
)
from dashboards.web.auth import COOKIE

bp = flask.Blueprint("pages", __name__)

# A path of this site, as the pages link to them: printable URL characters only (no
# control characters to split a header with, no backslash), bounded.
_LOCAL_PATH = re.compile(r"/[A-Za-z0-9._~!$&'()*+,;=:@%/?-]{0,500}")

TRANSITION_RPC = "/skiff.v1.RolloutService/TransitionRollout"
LIST_DEVICES_RPC = "/skiff.v1.FleetService/ListDevices"
GET_DEVICE_RPC = "/skiff.v1.FleetService/GetDevice"
DEVICES_PER_PAGE = 50
CHART_WINDOWS = (1, 6, 24, 168)
DEFAULT_HOURS = 6
# The words `skiff rollout pause|resume|promote|rollback` print for the same change.
ACTION_TEXT = {
    "pause": "Pause: the rollout stays at its current stage until it is resumed: neither its "
    "bake time nor a promote moves it on; the devices this stage includes keep the version "
    "(one that has not installed it yet still gets it), and no other device gets it.",
    "resume": "Resume: the rollout goes on from its current stage, whose bake time starts over.",
    "promote": "Promote: move to the next stage now (or complete the rollout from its last).",
    "rollback": "Roll back: every device this rollout moved returns to the version it had "
    "without it. This cannot be undone.",
}
SLICE_TEXT = {
    "rollback": "Roll back this slice: its devices return to the version they had without "
    "this rollout; the other slices go on.",
    "resume": "Readmit this slice: its devices get this version again as the stages allow.",
}


def _hours() -> float:
    raw = flask.request.args.get("hours", str(DEFAULT_HOURS))
    try:
        return float(raw)
    except ValueError:
        raise errors.InvalidArgument(f"hours must be a number, not {raw[:20]!r}") from None


def _safe_next(target: str | None) -> str:
    """Return a same-site path to go to after login (never another host, nor a header)."""
    if not target or not _LOCAL_PATH.fullmatch(target) or target.startswith(("//", "/\\")):
        return flask.url_for("pages.overview")
    return target


def _page(template: str, **context):
    return flask.render_template(template, caller=caller(), **context)


@bp.route("/login", methods=["GET", "POST"])
def login():
    """Show the login form; on a valid token, start a session.

    Throttled per client address and overall (429 with Retry-After, the token unchecked).
    """
    target = _safe_next(flask.request.values.get("next"))
    if flask.request.method == "GET":
        return flask.render_template("login.html", next=target, message="")
    try:
        with attempt():
            secret, record = sessions().login(flask.request.form.get("token", ""))
    except (errors.Unauthenticated, Throttled) as exc:
        page = flask.render_template("login.html", next=target, message=str(exc))
        return retry_after(flask.make_response(page, status_of(exc)), exc)
    response = flask.redirect(target)
    set_session_cookie(response, secret)
    flask.current_app.logger.info("dashboard login: token %s (%s)", record.id, record.role)
    return response


@bp.post("/logout")
def logout():
    """End this session."""
    sessions().check_csrf(caller(), flask.request.form.get("csrf"))
    sessions().logout(flask.request.cookies.get(COOKIE))
    response = flask.redirect(flask.url_for("pages.login"))
    response.delete_cookie(COOKIE, path="/")
    return response


@bp.get("/")
def overview():
    """Show the fleet overview and the rollouts still in progress."""
    app = skiff()
    live = [r for r in data.rollouts(app) if r["state"] in ("active", "paused")]
    return _page("overview.html", fleet=data.fleet_summary(app), rollouts=live)


@bp.get("/devices")
def devices():
    """List the devices a selector picks (the whole fleet by default), a page at a time.

    The selector is `skiff fleet ls --select`'s, checked by the same parser: a bad one
    is shown on the page (400) with the box still holding it, to correct.
    """
    caller().require(LIST_DEVICES_RPC)
    args = flask.request.args
    selector, token = args.get("select", ""), args.get("page_token", "")
    per_page = _count(args.get("per_page", ""), DEVICES_PER_PAGE, paging.MAX_PAGE_SIZE)
    start = _count(args.get("start", ""), 1)
    shown = {"select": selector, "per_page": per_page, "start": start, "usual": DEVICES_PER_PAGE}
    try:
        found, next_token = data.devices_page(skiff(), selector, per_page, token, telemetry=True)
    except errors.InvalidArgument as exc:
        return _page("devices.html", devices=[], error=str(exc), **shown), 400
    return _page(
        "devices.html", devices=found, error="", next_token=next_token, paged=bool(token), **shown
    )


def _count(raw: str, default: int, high: int = 10**9) -> int:
    """Return a positive whole number from a link's query (the default when it is not)."""
    # isascii: "²".isdigit() is true, and int() refuses it.
    return int(raw) if raw.isascii() and raw.isdigit() and 0 < int(raw) <= high else default


@bp.get("/devices/<device_id>")
def device(device_id: str):
    """Show one device: what `skiff fleet show DEVICE` shows (a unique id prefix goes to it)."""
    caller().require(GET_DEVICE_RPC)
    doc = data.device(skiff(), device_id)
    if doc["id"] != device_id:
        return flask.redirect(flask.url_for("pages.device", device_id=doc["id"]))
    return _page("device.html", d=doc)


@bp.get("/models")
def models():
    """List every model."""
    return _page("models.html", models=data.models(skiff()))


@bp.get("/models/<name>")
def model(name: str):
    """List one model's versions."""
    return _page("model.html", doc=data.model_versions(skiff(), name))


@bp.get("/models/<name>/<int:version>")
def version(name: str, version: int):
    """Show a version as `skiff model show` does, then its telemetry: charts, backends."""
    app, hours = skiff(), _hours()
    doc = data.version_doc(app, name, version)  # NotFound names what is missing
    return _page(
        "version.html",
        v=doc["versions"][0],
        accuracy_checks=data.accuracy_checks,
        degraded_label=data.degraded_label,
        backends=data.backends(app, name, version),
        series=data.version_series(app, name, version, hours),
        hours=hours,
        windows=CHART_WINDOWS,
    )


@bp.get("/rollouts")
def rollouts():
    """List every rollout."""
    return _page("rollouts.html", rollouts=data.rollouts(skiff()))


@bp.get("/rollouts/<rollout_id>")
def rollout(rollout_id: str):
    """Show a rollout: stages, counts, guardrail figures, slices, charts, audit log."""
    app, hours = skiff(), _hours()
    doc = data.rollout(app, rollout_id)
    return _page(
        "rollout.html",
        r=doc,
        paused_text=data.paused_text(doc),
        series=data.rollout_series(app, doc["id"], hours),  # the whole id, not a prefix
        actions=data.allowed_actions(doc["state"]),
        can_act=caller().may(TRANSITION_RPC),
        hours=hours,
        windows=CHART_WINDOWS,
        notice=flask.request.args.get("done", ""),
    )


@bp.get("/rollouts/<rollout_id>/confirm")
def confirm(rollout_id: str):
    """Ask before an action, saying what it will do; the form carries what was seen."""
    caller().require(TRANSITION_RPC)
    action = flask.request.args.get("action", "")
    piece = flask.request.args.get("slice", "")
    doc = data.rollout(skiff(), rollout_id)
    texts = SLICE_TEXT if piece else ACTION_TEXT
    if action not in texts:
        raise errors.InvalidArgument(f"unknown action {action[:20]!r}")
    if not piece and action not in data.allowed_actions(doc["state"]):
        # The refusal the action would meet, said before asking (a paused rollout: resume).
        data.check_action(doc, action)
    seen = _slice_state(doc, piece) if piece else doc["state"]
    return _page("confirm.html", r=doc, action=action, slice=piece, seen=seen, text=texts[action])


@bp.post("/rollouts/<rollout_id>/actions")
def act(rollout_id: str):
    """Apply a confirmed action, refusing a forged or stale form."""
    who = caller()
    sessions().check_csrf(who, flask.request.form.get("csrf"))
    who.require(TRANSITION_RPC)
    form = flask.request.form
    action, piece = form.get("action", ""), form.get("slice", "")
    app = skiff()
    current = data.rollout(app, rollout_id)
    now = _slice_state(current, piece) if piece else current["state"]
    if form.get("seen_state") != now or form.get("seen_stage") != str(current["stage"]):
        raise errors.FailedPrecondition(
            f"rollout {rollout_id} changed since this form was shown (it is now {now}, "
            f"stage {current['stage']} of {len(current['stages'])}): look again and retry"
        )
    app.ops.transition(
        rollout_id,
        action,
        actor=who.token.name,
        reason=form.get("reason", "")[:500] or "from the dashboard",
        expected_stage=None if piece else current["stage"],
        slice=piece,
    )
    done = f"{action} {piece}".strip()
    return flask.redirect(flask.url_for("pages.rollout", rollout_id=rollout_id, done=done))


def _slice_state(doc: dict, piece: str) -> str:
    """Return the state of one slice of a rollout document; NotFound if it has none such."""
    for s in (doc.get("health") or {}).get("slices", []):
        if s["slice"] == piece:
            return s["state"]
    raise errors.NotFound(f"rollout {doc['id']} has no slice {piece[:80]!r}")
