"""Dashboard sessions on SQLite and PostgreSQL, and the session keeper over them."""

from __future__ import annotations

import datetime as dt

import pytest

from contract import errors
from control_plane.api.auth import ApiTokens
from control_plane.store.sql_store import SqlStore
from dashboards.web.auth import SESSION_TTL, Sessions, csrf_for


@pytest.fixture
def store(db_url):
    s = SqlStore(db_url)
    yield s
    s.close()


class Clock:
    def __init__(self) -> None:
        self.now = dt.datetime.now(dt.UTC)

    def __call__(self) -> dt.datetime:
        return self.now


def test_a_session_is_found_by_its_hash_and_ended(store):
    secret = ApiTokens(store).create(role="viewer", name="v", ttl_s=0, actor="t").secret
    sessions = Sessions(store, store)
    cookie, record = sessions.login(secret)
    assert record.role == "viewer" and secret not in cookie
    assert sessions.resolve(cookie).token.id == record.id
    sessions.logout(cookie)
    with pytest.raises(errors.Unauthenticated, match="session ended"):
        sessions.resolve(cookie)


def test_sessions_expire_and_die_with_their_token(store):
    tokens = ApiTokens(store)
    made = tokens.create(role="operator", name="op", ttl_s=0, actor="t")
    clock = Clock()
    sessions = Sessions(store, store, clock=clock)
    cookie, _ = sessions.login(made.secret)
    clock.now += SESSION_TTL + dt.timedelta(seconds=1)
    with pytest.raises(errors.Unauthenticated):
        sessions.resolve(cookie)
    clock.now = dt.datetime.now(dt.UTC)
    cookie, _ = sessions.login(made.secret)  # (also prunes the expired one)
    tokens.revoke(made.record.id)
    with pytest.raises(errors.Unauthenticated, match="no longer valid"):
        sessions.resolve(cookie)


def test_nothing_but_a_real_token_logs_in(store):
    ApiTokens(store).create(role="admin", name="a", ttl_s=0, actor="t")
    sessions = Sessions(store, store)
    for bad in ("", "   ", "skf_nope", "Bearer x", "x" * 10_000):
        with pytest.raises(errors.Unauthenticated):
            sessions.login(bad)
    for bad in (None, "", "nope", "y" * 200):
        with pytest.raises(errors.Unauthenticated):
            sessions.resolve(bad)


def test_csrf_is_bound_to_the_session(store):
    secret = ApiTokens(store).create(role="admin", name="a", ttl_s=0, actor="t").secret
    sessions = Sessions(store, store)
    one, _ = sessions.login(secret)
    two, _ = sessions.login(secret)
    caller = sessions.resolve(one)
    Sessions.check_csrf(caller, csrf_for(one))
    for forged in (None, "", csrf_for(two), csrf_for(one).upper(), "0" * 64):
        with pytest.raises(errors.PermissionDenied, match="stale"):
            Sessions.check_csrf(caller, forged)
    with pytest.raises(errors.PermissionDenied):  # a bearer caller has no session to post from
        Sessions.check_csrf(sessions.bearer(f"Bearer {secret}"), csrf_for(one))


def test_logging_in_again_and_again_keeps_a_bounded_number_of_sessions(store):
    from control_plane.store.sessions import MAX_SESSIONS_PER_TOKEN

    secret = ApiTokens(store).create(role="viewer", name="v", ttl_s=0, actor="t").secret
    clock = Clock()
    sessions = Sessions(store, store, clock=clock)
    cookies = []
    for _ in range(MAX_SESSIONS_PER_TOKEN + 5):
        clock.now += dt.timedelta(seconds=1)
        cookies.append(sessions.login(secret)[0])
    live = []
    for cookie in cookies:
        try:
            sessions.resolve(cookie)
            live.append(cookie)
        except errors.Unauthenticated:
            pass
    assert live == cookies[-MAX_SESSIONS_PER_TOKEN:]
