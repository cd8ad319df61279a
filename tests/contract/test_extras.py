"""What an install holds: skiff's own entry points only, and the server extra's requirements."""

from __future__ import annotations

import importlib.metadata as metadata
from types import SimpleNamespace

import pytest

from contract import extras

REQUIRES = [
    "numpy>=1.26",
    'packaging>=23; python_version >= "3.8"',  # a base requirement with a marker
    'sqlalchemy>=2.0; extra == "server"',
    'rich>=13; extra == "server"',
    'numpy>=99; extra == "server"',  # installed, but too old
    'skiff[postgres]; extra == "server"',
    'psycopg[binary]>=3.2; extra == "postgres"',
]
INSTALLED = {"numpy": "2.0.0", "packaging": "24.0", "rich": "13.7.0"}


@pytest.fixture
def fake_install(monkeypatch):
    def distribution(name):
        if name not in INSTALLED:
            raise metadata.PackageNotFoundError(name)
        return SimpleNamespace(name=name)

    monkeypatch.setattr(metadata, "requires", lambda name: list(REQUIRES))
    monkeypatch.setattr(metadata, "distribution", distribution)
    monkeypatch.setattr(metadata, "version", lambda name: INSTALLED[name])
    # Read once per process: forget this install's metadata, and then the fake one.
    for cached in (extras._requirements, extras._missing):
        cached.cache_clear()
    yield
    for cached in (extras._requirements, extras._missing):
        cached.cache_clear()


def test_only_the_extras_own_requirements_and_versions_count(fake_install):
    # The base requirement with a marker is not the server's; numpy is there but too old.
    assert extras.missing_requirements("server") == ["sqlalchemy", "numpy"]
    assert extras.missing_requirements("server", nested=True) == ["sqlalchemy", "numpy", "psycopg"]
    assert extras.missing_requirements("postgres") == ["psycopg"]


def test_the_refusal_names_what_is_missing(fake_install):
    line = extras.operator_refusal("model")
    assert line == (
        "skiff: 'skiff model' is an operator command, and this install lacks sqlalchemy, "
        "numpy: pip install 'skiff[server]'"
    )
    INSTALLED.pop("rich")
    extras._missing.cache_clear()  # another install, as far as the metadata says
    try:
        assert "this install has the device side only" in extras.operator_refusal("model")
    finally:
        INSTALLED["rich"] = "13.7.0"


def test_only_skiffs_own_entry_points_are_used(monkeypatch):
    def point(name, dist):
        return SimpleNamespace(name=name, dist=None if dist is None else SimpleNamespace(name=dist))

    found = [point("zzz", "skiff"), point("aaa", "evil-plugin"), point("dashboard", "Skiff")]
    found.append(point("orphan", None))
    monkeypatch.setattr(extras, "entry_points", lambda group, **kw: found)
    assert [e.name for e in extras.own_entry_points("skiff.http")] == ["dashboard", "zzz"]


def test_this_install_has_the_server_extra():
    # make install installs -e '.[server,test]': nothing of the server may be missing.
    assert extras.missing_requirements("server", nested=True) == []
    assert extras.operator_refusal("model") is None
    names = {e.name for e in extras.own_entry_points("skiff.http")}
    assert names == {"dashboard"}
