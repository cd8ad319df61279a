"""Profiles: validation names the bad entry, draws are reproducible and realistic."""

from __future__ import annotations

import collections
import json

import pytest

from contract import errors
from control_plane.cli.main import main
from control_plane.fleet.attributes import normalize_attributes
from control_plane.sim.profile import load_profile, parse_profile

APPLE_SOCS = {"a17pro", "a16"}
BOX_SOCS = {"rk3588", "tegra234", "bcm2712"}


def test_default_profile_is_realistic_and_canonical():
    profile = load_profile()
    draws = [profile.attributes(seed=0, index=i) for i in range(3000)]
    platforms = collections.Counter(a["platform"] for a in draws)
    assert 0.52 < platforms["android"] / 3000 < 0.64
    assert 0.20 < platforms["ios"] / 3000 < 0.30
    assert 0.13 < platforms["linux"] / 3000 < 0.21
    for a in draws:
        assert normalize_attributes(a) == a
        # Attributes are correlated per class: no iPhone with a Rockchip SoC.
        assert (a["soc"] in APPLE_SOCS) == (a["platform"] == "ios")
        assert (a["soc"] in BOX_SOCS) == (a["platform"] == "linux")
        assert a["app_version"] in {"5.0", "5.1", "5.2", "5.3", "5.4"}
    assert len({a["region"] for a in draws}) == 5
    assert 0.02 < sum("beta" in a["tags"] for a in draws) / 3000 < 0.08


def test_draws_depend_only_on_seed_and_index():
    profile = load_profile()
    first = [profile.attributes(seed=3, index=i) for i in range(50)]
    # Drawing device 40 alone (a later run adding devices) gives what it got in a batch.
    assert profile.attributes(seed=3, index=40) == first[40]
    assert [profile.attributes(seed=3, index=i) for i in range(50)] == first
    assert [profile.attributes(seed=4, index=i) for i in range(50)] != first


def test_explicit_list_cycles_and_tags_are_independent():
    listed = parse_profile(
        {"devices": [{"attributes": {"platform": "ios"}}, {"attributes": {"soc": "rk3588"}}]}
    )
    assert [listed.attributes(0, i) for i in range(3)] == [
        {"platform": "ios"},
        {"soc": "rk3588"},
        {"platform": "ios"},
    ]
    mixed = parse_profile({"mix": {"ram_mb": {"4096": 1}, "tags": {"never": 0, "always": 1}}})
    assert mixed.attributes(0, 0) == {"ram_mb": 4096, "tags": ["always"]}


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ([], "must be a JSON object"),
        ({}, "needs 'devices', 'mix', 'classes' or 'inject'"),
        ({"mix": {"platform": {"ios": 1}}, "devices": []}, "more than one of"),
        ({"mixes": {}}, "unknown key 'mixes'"),
        (
            {"mix": {"platform": {"android": 0.7, "ios": 0.2}}},
            "mix.platform: probabilities sum to 0.9",
        ),
        ({"mix": {"colour": {"red": 1}}}, "mix: unknown attribute key colour"),
        ({"mix": {"ram_mb": {"lots": 1}}}, "mix.ram_mb value 'lots': attribute 'ram_mb'"),
        ({"mix": {"tags": {"beta": 1.5}}}, "mix.tags['beta'] must be a probability from 0 to 1"),
        ({"mix": {"tags": {"bad tag": 0.5}}}, "mix.tags: tag 'bad tag'"),
        ({"mix": {"region": {"eu": True}}}, "mix.region['eu'] must be a probability"),
        ({"devices": []}, "'devices' must be a non-empty list"),
        (
            {"devices": [{"attributes": {"platform": 3}}]},
            "devices[0].attributes: attribute 'platform' must be a string",
        ),
        ({"devices": [{"platform": "ios"}]}, "devices[0] must be an object with just 'attributes'"),
        (
            {"classes": [{"weight": 0.5, "mix": {"platform": {"ios": 1}}}]},
            "classes weights: probabilities sum to 0.5",
        ),
        ({"classes": [{"weight": 1, "mix": {}}]}, "classes[0].mix must be a non-empty object"),
    ],
)
def test_invalid_profiles_name_the_problem(data, message):
    with pytest.raises(errors.InvalidArgument) as caught:
        parse_profile(data, source="p.json")
    assert str(caught.value).startswith("p.json: ")
    assert message in str(caught.value)


def test_profile_files_that_cannot_be_read(tmp_path):
    with pytest.raises(errors.InvalidArgument, match="cannot read profile"):
        load_profile(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(errors.InvalidArgument, match="is not JSON"):
        load_profile(bad)


def test_cli_refuses_a_bad_profile_before_dialing(tmp_path, capsys):
    bad = tmp_path / "mix.json"
    bad.write_text(json.dumps({"mix": {"platform": {"android": 0.5}}}))
    # No server listens here: the profile must be refused before anything is dialed.
    argv = ["sim", "--home", str(tmp_path), "--server", "127.0.0.1:1", "--devices", "5"]
    code = main([*argv, "--profile", str(bad), "--once", "--json"])
    out, err = capsys.readouterr()
    assert code == 3
    assert out == ""
    assert err.strip().splitlines() == [
        f"skiff: error: {bad}: mix.platform: probabilities sum to 0.5, not 1"
    ]
