"""Token guessing at the dashboard (login form and bearer API) is throttled per address.

A real dashboard server over TLS on a fresh home; the throttle's clock is a fake the
tests move, and other client addresses are other loopback sources (127.0.0.2...).
"""

from __future__ import annotations

import html
from dataclasses import dataclass

import pytest
import requests
from requests.adapters import HTTPAdapter

from control_plane.api import throttle as mod
from control_plane.api.throttle import Limit, Throttle
from dashboards.server import DashboardServer
from dashboards.web.auth import COOKIE
from tests.control_plane.helpers import ControlPlane, start_control_plane

BURST, INTERVAL = mod.PER_KEY.burst, int(mod.PER_KEY.interval_s)


class Clock:
    """A monotonic clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class _From(HTTPAdapter):
    """Connect from a given local address, so the server sees another client."""

    def __init__(self, source: str) -> None:
        self._source = source
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self._source, 0)
        super().init_poolmanager(*args, **kwargs)


@dataclass
class Dashboard:
    cp: ControlPlane
    server: DashboardServer
    clock: Clock

    @property
    def url(self) -> str:
        return self.server.url

    def client(self, source: str = "127.0.0.1") -> requests.Session:
        s = requests.Session()
        s.trust_env, s.verify = False, self.cp.config.tls_ca
        s.mount("https://", _From(source))
        return s

    def login(self, token: str, source: str = "127.0.0.1") -> requests.Response:
        return self.client(source).post(
            self.url + "login", data={"token": token, "next": "/"}, allow_redirects=False
        )


@pytest.fixture(scope="module")
def cp(tmp_path_factory):
    cp = start_control_plane(tmp_path_factory.mktemp("throttle") / "home")
    yield cp
    cp.stop()


def _serve(cp: ControlPlane, **limits) -> Dashboard:
    clock = Clock()
    throttle = Throttle(name="dashboard login", clock=clock, **limits)
    return Dashboard(cp, DashboardServer(cp.app, "127.0.0.1:0", throttle=throttle).start(), clock)


@pytest.fixture
def dash(cp):
    d = _serve(cp)
    yield d
    d.server.stop()


def _counting_lookups(cp: ControlPlane, monkeypatch) -> list[str]:
    seen: list[str] = []
    find = cp.app.store.find_token

    def counted(digest):
        seen.append(digest)
        return find(digest)

    monkeypatch.setattr(cp.app.store, "find_token", counted)
    return seen


def test_300_bad_logins_are_answered_429_after_the_limit_unchecked(dash, monkeypatch):
    lookups = _counting_lookups(dash.cp, monkeypatch)
    s = dash.client()
    answers = [
        s.post(dash.url + "login", data={"token": f"skf_guess{i}", "next": "/"}) for i in range(300)
    ]
    assert [r.status_code for r in answers] == [401] * BURST + [429] * (300 - BURST)
    assert "invalid token" in answers[0].text and "Retry-After" not in answers[0].headers
    assert len(lookups) == BURST  # throttled guesses never reach the token store
    for r in answers[BURST:]:
        assert r.headers["Retry-After"] == str(INTERVAL)
        assert COOKIE not in r.cookies
    page = html.unescape(answers[-1].text)
    assert f"too many failed attempts from your address: try again in {INTERVAL} s" in page
    assert 'id="login-error"' in page and 'name="token"' in page  # the form, to try later


def test_a_valid_token_waits_out_the_lock_out_of_its_address(dash):
    for i in range(BURST):
        assert dash.login(f"skf_guess{i}").status_code == 401
    r = dash.login(dash.cp.token)  # the right token, from the locked-out address
    assert r.status_code == 429 and COOKIE not in r.cookies
    assert r.headers["Retry-After"] == str(INTERVAL)
    # Another address is not held back by this one's failures.
    other = dash.login(dash.cp.token, source="127.0.0.2")
    assert other.status_code == 302 and COOKIE in other.cookies
    dash.clock.now += INTERVAL - 1
    assert dash.login(dash.cp.token).status_code == 429
    dash.clock.now += 1  # exactly Retry-After later
    r = dash.login(dash.cp.token)
    assert r.status_code == 302 and COOKIE in r.cookies


def test_bad_bearer_tokens_share_the_login_budget(dash, monkeypatch):
    lookups = _counting_lookups(dash.cp, monkeypatch)
    s = dash.client()
    for i in range(BURST - 1):
        r = s.get(dash.url + "api/v1/fleet", headers={"Authorization": f"Bearer skf_g{i}"})
        assert r.status_code == 401
    assert dash.login("skf_from-the-form").status_code == 401  # the tenth failure
    assert len(lookups) == BURST
    for path in ("api/v1/fleet", "metrics"):
        r = s.get(dash.url + path, headers={"Authorization": f"Bearer {dash.cp.token}"})
        assert r.status_code == 429 and r.headers["Retry-After"] == str(INTERVAL)
        assert r.json()["error"]["code"] == "Throttled"
    assert len(lookups) == BURST  # refused before the lookup, valid token or not
    other = dash.client("127.0.0.2")
    r = other.get(dash.url + "api/v1/fleet", headers={"Authorization": f"Bearer {dash.cp.token}"})
    assert r.status_code == 200


def test_the_overall_limit_spares_addresses_that_logged_in_recently(cp):
    d = _serve(cp, overall=Limit(burst=3, interval_s=1.0))
    try:
        assert d.login(cp.token, source="127.0.0.3").status_code == 302  # an operator
        for source in ("127.0.0.4", "127.0.0.5", "127.0.0.6"):  # each under its own limit
            assert d.login("skf_spray", source=source).status_code == 401
        r = d.login(cp.token, source="127.0.0.7")  # a first login now waits like the rest
        assert r.status_code == 429 and r.headers["Retry-After"] == "1"
        assert "from many addresses" in r.text
        assert d.login(cp.token, source="127.0.0.3").status_code == 302
        d.clock.now += 1
        assert d.login(cp.token, source="127.0.0.7").status_code == 302
    finally:
        d.server.stop()
