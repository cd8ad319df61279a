"""Who may see and do what on the dashboard, and the attacks a browser session invites."""

from __future__ import annotations

import html

import pytest

from contract import errors
from dashboards.server import DashboardServer
from dashboards.web.auth import COOKIE
from dashboards.web.data import CLIENT_TRUST_KEYS
from tests.dashboards.conftest import VARIANTS_MODEL, Site

# One worker runs the module, so its scenario (the `site` fixture) is built once.
pytestmark = pytest.mark.xdist_group("dashboard-access")


def _token(site: Site, role: str) -> tuple[str, str]:
    with site.cp.client() as client:
        made = client.create_api_token(role=role)
    return made.secret, made.token.id


@pytest.mark.parametrize(
    "path",
    [
        "",
        "models",
        "models/det",
        "models/det/2",
        "rollouts",
        "rollouts/{guarded}",
        "devices",
        "devices?select=soc%3Dsm8450",
        "devices/{attested}",
    ],
)
def test_pages_without_a_session_redirect_to_login_and_show_no_data(site, path):
    path = path.format(guarded=site.guarded, attested=site.attested)
    for cookie in (None, "forged-session-value", "x" * 4000):
        s = site.http()
        if cookie:
            s.cookies.set(COOKIE, cookie)
        r = s.get(site.url + path, allow_redirects=False)
        assert r.status_code == 302
        assert r.headers["Location"].startswith("/login?next=")
        # Nothing but the link to the login page (which names the page asked for).
        assert "<table" not in r.text and "det:2" not in r.text and "active" not in r.text


@pytest.mark.parametrize(
    "path",
    [
        "api/v1/fleet",
        "api/v1/rollouts",
        "api/v1/devices",
        "api/v1/devices/{attested}",
        "api/v1/models/det/2",
        "metrics",
    ],
)
def test_the_api_and_metrics_want_a_valid_token(site, path):
    path = path.format(attested=site.attested)
    s = site.http()
    assert s.get(site.url + path).status_code == 401
    r = s.get(site.url + path, headers={"Authorization": "Bearer skf_not-a-token"})
    assert r.status_code == 401
    assert "skf_not-a-token" not in r.text  # never echoed
    r = s.get(site.url + path, headers={"Authorization": f"Bearer {site.cp.token}"})
    assert r.status_code == 200


def test_a_viewer_reads_the_devices_and_version_pages(site):
    secret, _ = _token(site, "viewer")
    s = site.login(secret)
    for path in ("devices", f"devices/{site.attested}", "models/det/2", ""):
        r = s.get(site.url + path, allow_redirects=False)
        assert r.status_code == 200, (path, r.status_code)
    assert site.attested in s.get(site.url + "devices?select=%40region%3Deu").text


def test_a_bad_token_is_refused_at_login_without_a_cookie(site):
    s = site.http()
    r = s.post(site.url + "login", data={"token": "skf_wrong", "next": "/"}, allow_redirects=False)
    assert r.status_code == 401 and "invalid token" in r.text
    assert COOKIE not in r.cookies and "skf_wrong" not in r.text


def test_the_session_cookie_is_secure_httponly_and_strict(site):
    r = site.http().post(
        site.url + "login", data={"token": site.cp.token, "next": "/"}, allow_redirects=False
    )
    assert r.status_code == 302
    cookie = r.headers["Set-Cookie"]
    for flag in ("Secure", "HttpOnly", "SameSite=Strict", "Path=/"):
        assert flag in cookie
    assert site.cp.token not in cookie  # the session, never the token
    for header in ("Content-Security-Policy", "X-Frame-Options", "X-Content-Type-Options"):
        assert header in r.headers


def test_login_never_redirects_off_site(site):
    for target in (
        "//evil.example/",
        "https://evil.example/",
        "/\\evil.example",
        "/\r\nSet-Cookie: a=b",
        "/" + "a" * 1000,
    ):
        r = site.http().post(
            site.url + "login", data={"token": site.cp.token, "next": target}, allow_redirects=False
        )
        assert r.headers["Location"] == "/"


def test_logout_ends_the_session_everywhere(site):
    s = site.login()
    stolen = s.cookies.get(COOKIE)
    csrf = site.csrf(s)
    assert s.post(site.url + "logout", data={"csrf": csrf}).url.endswith("/login")
    replay = site.http()
    replay.cookies.set(COOKIE, stolen)
    assert replay.get(site.url, allow_redirects=False).status_code == 302


def test_revoking_the_token_ends_its_sessions(site):
    secret, token_id = _token(site, "viewer")
    s = site.login(secret)
    assert s.get(site.url + "rollouts", allow_redirects=False).status_code == 200
    with site.cp.client() as client:
        client.revoke_api_token(token_id)
    assert s.get(site.url + "rollouts", allow_redirects=False).status_code == 302


def _act(site: Site, s, rollout_id: str, **fields):
    doc = site.cli("rollout", "show", rollout_id)
    form = {
        "action": "pause",
        "slice": "",
        "seen_state": doc["state"],
        "seen_stage": str(doc["stage"]),
        **fields,
    }
    return s.post(site.url + f"rollouts/{rollout_id}/actions", data=form, allow_redirects=False)


def test_a_forged_or_stale_form_changes_nothing(site):
    before = site.cli("rollout", "show", site.staged)
    s = site.login()
    # No CSRF value, a made-up one, and one from a session that has ended.
    assert _act(site, s, site.staged).status_code == 403
    assert _act(site, s, site.staged, csrf="0" * 64).status_code == 403
    old = site.login()
    old_csrf = site.csrf(old)
    old.post(site.url + "logout", data={"csrf": old_csrf})
    assert _act(site, s, site.staged, csrf=old_csrf).status_code == 403
    # The right CSRF value, but for a state the rollout is no longer in.
    r = _act(site, s, site.staged, csrf=site.csrf(s), seen_state="paused")
    assert r.status_code == 409 and "changed since this form was shown" in html.unescape(r.text)
    after = site.cli("rollout", "show", site.staged)
    assert after["state"] == "active" and after["audit"] == before["audit"]


def test_a_cross_origin_post_is_refused(site):
    s = site.login()
    csrf = site.csrf(s)
    doc = site.cli("rollout", "show", site.staged)
    r = s.post(
        site.url + f"rollouts/{site.staged}/actions",
        data={"csrf": csrf, "action": "pause", "seen_state": doc["state"], "seen_stage": "1"},
        headers={"Origin": "https://evil.example"},
        allow_redirects=False,
    )
    assert r.status_code == 403
    assert site.cli("rollout", "show", site.staged)["state"] == "active"


def test_a_viewer_sees_but_cannot_act(site):
    secret, _ = _token(site, "viewer")
    s = site.login(secret)
    page = s.get(site.url + f"rollouts/{site.staged}").text
    assert 'id="actions"' not in page
    assert s.get(site.url + f"rollouts/{site.staged}/confirm?action=pause").status_code == 403
    r = _act(site, s, site.staged, csrf=site.csrf(s))
    assert r.status_code == 403 and "TransitionRollout needs operator" in r.text
    api = site.http().post(
        site.url + f"api/v1/rollouts/{site.staged}/pause",
        json={"reason": "x"},
        headers={"Authorization": f"Bearer {secret}"},
    )
    assert api.status_code == 403 and api.json()["error"]["code"] == "PermissionDenied"
    assert site.cli("rollout", "show", site.staged)["state"] == "active"


def test_the_api_answers_what_the_cli_prints(site):
    s, auth = site.http(), {"Authorization": f"Bearer {site.cp.token}"}

    def api(path: str):
        r = s.get(site.url + "api/v1/" + path, headers=auth)
        assert r.status_code == 200, r.text
        return r.json()

    assert api("rollouts") == site.cli("rollout", "ls")
    assert api(f"rollouts/{site.guarded}") == site.cli("rollout", "show", site.guarded)
    assert api("models/det/2/backends") == site.cli("model", "show", "det:2", "--backends")
    assert api("models") == site.cli("model", "ls")
    # Lists have the CLI's one shape ({"devices": [...], "more": ...}), paged by token.
    listed = site.cli("fleet", "ls")
    ids = [d["id"] for d in listed["devices"]]
    devices = api("devices")
    assert [d["id"] for d in devices["devices"]] == ids and devices["more"] is False
    first = s.get(site.url + "api/v1/devices?limit=5", headers=auth)
    token = first.headers["X-Next-Page-Token"]
    assert first.json()["more"] is True and [d["id"] for d in first.json()["devices"]] == ids[:5]
    then = api(f"devices?limit=5&page_token={token}")
    assert [d["id"] for d in then["devices"]] == ids[5:10]
    # One device as `fleet show` prints it, by its id or any unique prefix of it (the
    # attested device never syncs: nothing on it moves between the two reads).
    shown = site.cli("fleet", "show", site.attested)
    assert api(f"devices/{site.attested}") == shown == api(f"devices/{site.attested[:12]}")
    # A version as `model show` prints it, less the CLI's own check of the signature.
    doc = site.cli("model", "show", f"{VARIANTS_MODEL}:1")
    for v in doc["versions"]:
        for key in CLIENT_TRUST_KEYS:
            v.pop(key, None)
    assert api(f"models/{VARIANTS_MODEL}/1") == doc


def test_bad_api_input_gets_a_clear_error(site):
    s, auth = site.http(), {"Authorization": f"Bearer {site.cp.token}"}
    for path, status, words in [
        (f"rollouts/{site.guarded}/series?hours=abc", 400, "hours must be a number"),
        (f"rollouts/{site.guarded}/series?hours=100000", 400, "hours must be above 0"),
        ("rollouts/RO-NOPE", 400, "invalid rollout id"),
        ("rollouts/ro_0000000000", 404, "ro_0000000000"),
        ("models/no-such-model/1/backends", 404, "no-such-model"),
        ("devices?limit=0", 400, "limit must be"),
        ("rollouts?model=" + "x" * 500, 400, ""),
        ("devices?select=platfrom%3Dandroid", 400, "did you mean `platform`"),
        ("devices?page_token=forged", 400, ""),
        ("devices/dev_zzzzzzzz", 404, "dev_zzzzzzzz"),
        ("devices/BAD!", 400, "invalid device id"),
        ("models/det/99", 404, "99"),
    ]:
        r = s.get(site.url + "api/v1/" + path, headers=auth)
        assert r.status_code == status, (path, r.text)
        assert words in r.json()["error"]["message"]
    r = s.post(site.url + f"api/v1/rollouts/{site.staged}/explode", json={}, headers=auth)
    assert r.status_code == 400 and "unknown action" in r.json()["error"]["message"]
    r = s.post(site.url + f"api/v1/rollouts/{site.staged}/pause", json=[1], headers=auth)
    assert r.status_code == 400


def test_text_from_operators_is_escaped(site):
    s = site.login()
    r = s.post(
        site.url + "api/v1/rollouts/" + site.staged + "/pause",
        json={"reason": "<script>alert(1)</script>"},
        headers={"Authorization": f"Bearer {site.cp.token}"},
    )
    assert r.status_code == 200
    page = s.get(site.url + f"rollouts/{site.staged}").text
    assert "<script>alert(1)</script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    site.cli("rollout", "resume", site.staged)


def test_plaintext_is_refused_off_loopback(site, tmp_path):
    from dataclasses import replace

    app = site.cp.app
    plain = replace(app.config, tls_cert="", tls_key="")
    with pytest.raises(errors.InvalidArgument, match="without TLS"):
        DashboardServer(replace(app, config=plain), "0.0.0.0:0")
    with pytest.raises(errors.InvalidArgument, match="HOST:PORT"):
        DashboardServer(app, "127.0.0.1")


# "null" is what a sandboxed frame on another site sends: a login posted from there would
# log the victim in as the attacker (login CSRF).
@pytest.mark.parametrize("origin", ["https://evil.example", "null"])
def test_a_login_posted_from_another_site_is_refused(site, origin):
    r = site.http().post(
        site.url + "login",
        data={"token": site.cp.token, "next": "/"},
        headers={"Origin": origin},
        allow_redirects=False,
    )
    assert r.status_code == 403 and COOKIE not in r.cookies
