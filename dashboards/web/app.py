"""The dashboard's Flask application: sessions, security headers, errors, blueprints.

Server-rendered pages (Jinja2, autoescaped) over the JSON API's documents, charts drawn
in the browser by Plotly from its own package (served here: nothing comes from a CDN),
and `/metrics` for Prometheus. Every request but the login page, static files and the
health check needs a session cookie (pages) or a bearer token (API, metrics). Logins and
bearer tokens are guesses at a token: both go through one failure throttle, keyed by the
socket's peer address (no proxy header is trusted), answering 429 with Retry-After.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from urllib.parse import urlsplit

import flask
import plotly
from werkzeug.exceptions import HTTPException

from contract import errors
from control_plane.api.throttle import Throttle, Throttled, client_key
from control_plane.app import App
from dashboards.metrics import Metrics
from dashboards.web.auth import COOKIE, SESSION_TTL, Caller, Sessions

log = logging.getLogger(__name__)

PLOTLY_JS = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
# Plotly draws with inline styles; scripts come only from this server.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
# One table from domain errors to HTTP statuses (as the gRPC API has one to status codes).
HTTP_STATUS: tuple[tuple[type[errors.SkiffError], int], ...] = (
    (Throttled, 429),
    (errors.InvalidArgument, 400),
    (errors.TooLarge, 413),
    (errors.OutOfRange, 400),
    (errors.Unauthenticated, 401),
    (errors.PermissionDenied, 403),
    (errors.NotFound, 404),
    (errors.AlreadyExists, 409),
    (errors.FailedPrecondition, 409),
    (errors.Unavailable, 503),
)
PUBLIC_ENDPOINTS = frozenset({"pages.login", "static", "vendor_plotly", "healthz"})
MAX_FORM_BYTES = 64 << 10


def status_of(exc: errors.SkiffError) -> int:
    """Return the HTTP status of a domain error (500 for the unforeseen)."""
    return next((code for kind, code in HTTP_STATUS if isinstance(exc, kind)), 500)


def create_app(
    app: App,
    *,
    secure_cookies: bool,
    metrics: Metrics | None = None,
    throttle: Throttle | None = None,
) -> flask.Flask:
    """Return the dashboard for `app`; `secure_cookies` when served over TLS.

    `throttle` counts failed logins and bad bearer tokens (default: its standard limits).
    """
    from dashboards.web import api, pages

    web = flask.Flask(__name__, static_folder="static", template_folder="templates")
    web.config.update(MAX_CONTENT_LENGTH=MAX_FORM_BYTES, MAX_FORM_MEMORY_SIZE=MAX_FORM_BYTES)
    web.extensions["skiff"] = app
    web.extensions["skiff.sessions"] = Sessions(app.store, app.store)
    web.extensions["skiff.secure_cookies"] = secure_cookies
    web.extensions["skiff.metrics"] = metrics or Metrics(app)
    web.extensions["skiff.throttle"] = (
        Throttle(name="dashboard login") if throttle is None else throttle
    )
    web.register_blueprint(pages.bp)
    web.register_blueprint(api.bp, url_prefix="/api/v1")

    @web.get("/static/vendor/plotly.min.js")
    def vendor_plotly():
        return flask.send_file(PLOTLY_JS, mimetype="text/javascript", max_age=86_400)

    @web.get("/healthz")
    def healthz():
        return {"ok": True}

    @web.get("/metrics")
    def metrics_page():
        caller().require("/skiff.v1.RolloutService/ListRollouts")
        body, content_type = web.extensions["skiff.metrics"].render()
        return flask.Response(body, content_type=content_type)

    web.before_request(_authenticate)
    web.after_request(_headers)
    web.register_error_handler(errors.SkiffError, _skiff_error)
    web.register_error_handler(HTTPException, _http_error)
    return web


def skiff() -> App:
    """Return the control plane this dashboard serves."""
    return flask.current_app.extensions["skiff"]


def sessions() -> Sessions:
    """Return the session keeper."""
    return flask.current_app.extensions["skiff.sessions"]


def attempt() -> contextlib.AbstractContextManager[None]:
    """Return the throttle's guard over a token check by this request's client address.

    Throttled before the check when the address (or everyone) failed too often;
    Unauthenticated from inside counts as a failure. See control_plane.api.throttle.
    """
    throttle: Throttle = flask.current_app.extensions["skiff.throttle"]
    return throttle.attempt(client_key(flask.request.remote_addr or ""))


def retry_after(response: flask.Response, exc: errors.SkiffError) -> flask.Response:
    """Add Retry-After (whole seconds) to the answer to a throttled request."""
    if isinstance(exc, Throttled):
        response.headers["Retry-After"] = str(exc.retry_after_s)
    return response


def caller() -> Caller:
    """Return the authenticated caller of this request."""
    return flask.g.caller


def is_api() -> bool:
    """Return whether this request is for the JSON API or metrics (no redirects there)."""
    return flask.request.path.startswith("/api/") or flask.request.path == "/metrics"


def _authenticate():
    """Find the caller: bearer token for the API and metrics, session cookie for pages."""
    flask.g.caller = None
    if flask.request.method == "POST":
        _same_origin()  # the login form too: no logging a victim in as the attacker
    if flask.request.endpoint in PUBLIC_ENDPOINTS:
        return None
    authorization = flask.request.headers.get("Authorization")
    if authorization and is_api():
        with attempt():
            flask.g.caller = sessions().bearer(authorization)
    else:
        flask.g.caller = sessions().resolve(flask.request.cookies.get(COOKIE))
    return None


def _same_origin() -> None:
    """Refuse a POST another site's page sent (defence in depth beside CSRF and SameSite).

    Browsers send our own origin on our forms; "null" comes from sandboxed frames and
    opaque origins, which is how another site would post the login form (login CSRF).
    Scripts send no Origin and are held to the CSRF value or a bearer token instead.
    """
    origin = flask.request.headers.get("Origin")
    if origin is not None and (origin == "null" or urlsplit(origin).netloc != flask.request.host):
        raise errors.PermissionDenied("cross-origin request refused")


def set_session_cookie(response: flask.Response, secret: str) -> None:
    """Set the session cookie: HttpOnly, SameSite=Strict, Secure over TLS."""
    response.set_cookie(
        COOKIE,
        secret,
        max_age=int(SESSION_TTL.total_seconds()),
        httponly=True,
        secure=flask.current_app.extensions["skiff.secure_cookies"],
        samesite="Strict",
        path="/",
    )


def _headers(response: flask.Response) -> flask.Response:
    response.headers.setdefault("Content-Security-Policy", CSP)
    response.headers["X-Content-Type-Options"] = "nosniff"
    response.headers["X-Frame-Options"] = "DENY"
    # Not no-referrer: with it browsers send "Origin: null" on our own form posts, and a
    # null origin is also what an attacker's sandboxed frame sends (see _same_origin).
    response.headers["Referrer-Policy"] = "same-origin"
    if flask.current_app.extensions["skiff.secure_cookies"]:
        response.headers["Strict-Transport-Security"] = "max-age=31536000"
    if not flask.request.path.startswith("/static/"):
        response.headers["Cache-Control"] = "no-store"
    return response


def _skiff_error(exc: errors.SkiffError):
    status = status_of(exc)
    if status == 500:
        log.error("dashboard %s %s: %s", flask.request.method, flask.request.path, exc)
    if is_api():
        kind = type(exc).__name__
        body = {"error": {"code": kind, "message": str(exc)}}
        return retry_after(flask.make_response(body, status), exc)
    if status == 401:
        target = flask.request.full_path.rstrip("?") if flask.request.method == "GET" else "/"
        return flask.redirect(flask.url_for("pages.login", next=target))
    page = flask.render_template("error.html", status=status, message=str(exc))
    return retry_after(flask.make_response(page, status), exc)


def _http_error(exc: HTTPException):
    if is_api():
        return {"error": {"code": exc.name, "message": exc.description}}, exc.code
    message = exc.description or exc.name
    return flask.render_template("error.html", status=exc.code, message=message), exc.code
