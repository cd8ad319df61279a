"""The selector language: each operator on each kind of key, missing keys, versions."""

from __future__ import annotations

import pytest

from contract import errors
from control_plane.fleet.attributes import effective_attributes
from control_plane.fleet.selector import compare_versions, parse_selector, parse_version
from tests.control_plane.fleet._selector_cases import BARE, PIXEL, matches

# -- each operator on each kind of key --------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("platform=android", True),
        ("platform=ios", False),
        ("platform=Android", False),
        ("platform!=ios", True),
        ("platform!=android", False),
        ("platform in (ios, android)", True),
        ("platform in (ios, linux)", False),
        ("platform not in (ios, linux)", True),
        ("platform not in (ios, android)", False),
        ("platform~and*", True),
        ("platform~*roid", True),
        ("platform~andr?id", True),
        ("platform~[ab]ndroid", True),
        ("platform~android", True),
        ("platform~ios*", False),
        ("platform~And*", False),
        ('device_model="Pixel 8 Pro"', True),
        ('device_model~"Pixel 8*"', True),
        ("soc=tensor_g3", True),
        ("region=eu", True),
        ("region in (us)", False),
    ],
)
def test_text_keys(text, expected):
    assert matches(text, PIXEL) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("app_version=5.10", True),
        ("app_version=5.10.0.0", True),
        ("app_version=5.1", False),
        ("app_version!=5.10", False),
        ("app_version!=5.9", True),
        ("app_version>5.9", True),
        ("app_version>5.10", False),
        ("app_version>=5.10", True),
        ("app_version<5.10.1", True),
        ("app_version<=5.10", True),
        ("app_version<5.10", False),
        ("app_version<6", True),
        ("app_version in (5.9, 5.10.0)", True),
        ("app_version in (5.9, 5.11)", False),
        ("app_version not in (5.9, 5.11)", True),
        ("app_version not in (5.9, 5.010)", False),
        ("app_version~5.10.*", True),
        ("app_version~5.10", False),  # `~` globs the raw string "5.10.0"
        ("os_version>=14", True),
        ("os_version<14.0.1", True),
        ("os_version=14.0.0", True),
        ("os_version>14", False),
    ],
)
def test_version_keys(text, expected):
    assert matches(text, PIXEL) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("ram_mb=12288", True),
        ("ram_mb=12288.0", True),
        ("ram_mb!=12288", False),
        ("ram_mb!=4096", True),
        ("ram_mb>12287", True),
        ("ram_mb>12288", False),
        ("ram_mb>=12288", True),
        ("ram_mb<12288.5", True),
        ("ram_mb<=12288", True),
        ("ram_mb<1e5", True),
        ("ram_mb>-1", True),
        ("ram_mb in (4096, 12288)", True),
        ("ram_mb in (4096, 8192)", False),
        ("ram_mb not in (4096, 8192)", True),
        ("ram_mb not in (12288)", False),
    ],
)
def test_ram_mb(text, expected):
    assert matches(text, PIXEL) is expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("batch=8", True),
        ("batch=8.0", True),
        ("batch=+8", True),
        ("batch=08", True),
        ("batch=9", False),
        ("batch!=8", False),
        ("batch!=9", True),
        ("batch>=8", True),
        ("batch>8", False),
        ("batch<10", True),  # as text "8" > "10"; as numbers 8 < 10
        ("batch<=7.5", False),
        ("batch in (4, 8)", True),
        ("batch in (4, 16)", False),
        ("batch not in (4, 16)", True),
        ("batch not in (8.00)", False),
        ("batch~8", True),
        ("batch~8*", True),
        ("ratio=.5", True),
        ("ratio=5e-1", True),
        ("ratio<1", True),
        ("tier=gold", True),
        ("tier!=gold", False),
        ("tier!=silver", True),
        ("tier!=8", True),  # a numeric constant against text compares as text
        ("tier=8", False),
        ("tier>=8", False),  # ordering needs a numeric device value
        ("tier<8", False),
        ("tier in (silver, gold)", True),
        ("tier in (8, gold)", True),
        ("batch in (8, gold)", True),
        ("tier not in (silver, 8)", True),
        ("tier not in (gold, 8)", False),
        ("tier~g*", True),
        ("tier~G*", False),
        ("build=x86", True),
        ("build>80", False),
    ],
)
def test_custom_keys(text, expected):
    assert matches(text, PIXEL) is expected


@pytest.mark.parametrize("value", ["1e400", "-1e400", "inf", "nan", "NaN", "1_000", " 8", "0x10"])
def test_custom_values_that_are_not_finite_decimal_numbers_do_not_order(value):
    # Overflowing exponents become inf, which would order above every number.
    assert not matches("x>=8", {"custom": {"x": value}})
    assert not matches("x<8", {"custom": {"x": value}})
    assert matches(f'x="{value}"', {"custom": {"x": value}})


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("tags=beta", True),
        ("tags=dogfood", True),
        ("tags=canary", False),
        ("tags!=canary", True),
        ("tags!=beta", False),
        ("tags in (canary, dogfood)", True),
        ("tags in (canary, nightly)", False),
        ("tags not in (canary, nightly)", True),
        ("tags not in (canary, beta)", False),
        ("tags~be*", True),
        ("tags~*food", True),
        ("tags~nightly*", False),
    ],
)
def test_tags(text, expected):
    assert matches(text, PIXEL) is expected


@pytest.mark.parametrize(
    "text", ["tags!=beta", "tags not in (beta)", "tags=x", "tags in (x)", "tags~*"]
)
def test_empty_tag_list_is_reported_but_holds_nothing(text):
    expected = text in ("tags!=beta", "tags not in (beta)")
    assert matches(text, {"tags": []}) is expected


# -- a missing key never matches --------------------------------------------------------

EVERY_OPERATOR_ON_EVERY_KIND = [
    *(f"platform{op}x" for op in ("=", "!=", "~")),
    "platform in (x)",
    "platform not in (x)",
    *(f"app_version{op}1" for op in ("=", "!=", "<", "<=", ">", ">=", "~")),
    "os_version in (1)",
    "os_version not in (1)",
    *(f"ram_mb{op}1" for op in ("=", "!=", "<", "<=", ">", ">=")),
    "ram_mb in (1)",
    "ram_mb not in (1)",
    *(f"batch{op}1" for op in ("=", "!=", "<", "<=", ">", ">=", "~")),
    *(f"tier{op}x" for op in ("=", "!=", "~")),
    "tier in (x)",
    "tier not in (x, 1)",
    *(f"tags{op}x" for op in ("=", "!=", "~")),
    "tags in (x)",
    "tags not in (x)",
]


@pytest.mark.parametrize("text", EVERY_OPERATOR_ON_EVERY_KIND)
def test_a_missing_key_never_matches(text):
    selector = parse_selector(text)
    assert not selector.matches(BARE)
    assert not selector.matches({"custom": {}})
    assert not selector.matches({"custom": {"other": "1"}, "region": "x"})


def test_the_missing_key_list_covers_every_operator():
    ops = {parse_selector(text).clauses[0].op for text in EVERY_OPERATOR_ON_EVERY_KIND}
    assert ops == {"=", "!=", "<", "<=", ">", ">=", "~", "in", "not in"}


# -- `@` clauses: attested values only --------------------------------------------------

# PIXEL's values, every one reported by the device itself (enrolled with a token that
# stamps nothing), and the same values every one stamped by its token.
CLAIMED = effective_attributes(PIXEL, {})
STAMPED = effective_attributes({}, PIXEL)
# Each key on PIXEL, clause by clause: these all match PIXEL's values.
EVERY_KEY_MATCHING_PIXEL = [
    "platform=android",
    "platform!=ios",
    "platform not in (ios)",
    "device_model~Pixel*",
    "soc in (tensor_g3, sm8650)",
    "region=eu",
    "app_version>=5.10",
    "os_version<15",
    "os_version!=13",
    "ram_mb>4096",
    "ram_mb not in (4096)",
    "tags=beta",
    "tags!=internal",
    "tags not in (internal)",
    "tags~dog*",
    "tier=gold",
    "tier!=free",
    "batch<=8",
    "ratio in (0.5)",
]


@pytest.mark.parametrize("text", EVERY_KEY_MATCHING_PIXEL)
def test_an_attested_clause_matches_only_attested_values(text):
    assert matches(text, CLAIMED) and matches(text, STAMPED)
    assert not matches("@" + text, CLAIMED)
    assert not matches("@" + text, PIXEL)
    assert matches("@" + text, STAMPED)


@pytest.mark.parametrize("text", EVERY_OPERATOR_ON_EVERY_KIND)
def test_an_attested_clause_on_a_key_not_attested_never_matches(text):
    # The device reports a value for every key (one that satisfies the `=` clauses);
    # its token stamps other keys, or nothing.
    reported = {
        "platform": "x",
        "app_version": "1",
        "os_version": "1",
        "ram_mb": 1,
        "tags": ["x"],
        "custom": {"batch": "1", "tier": "x"},
    }
    selector = parse_selector("@" + text)
    assert not selector.matches(BARE)
    for stamped in ({}, {"custom": {"other": "1"}}, {"region": "x"}):
        device = effective_attributes(reported, stamped)
        assert not selector.matches(device)


def test_an_empty_stamped_tag_list_attests_no_tags():
    # Over gRPC a token without tags stores an empty list: the device's own tags count,
    # unattested, and no `@tags` clause matches (not even `!=`).
    device = effective_attributes({"tags": ["internal"]}, {"tags": [], "region": "eu"})
    assert matches("tags=internal", device) and matches("@region=eu", device)
    for text in ("@tags=internal", "@tags!=internal", "@tags not in (x)", "@tags~*"):
        assert not matches(text, device), text


def test_the_reproduction_a_claimed_tag_is_not_an_attested_one():
    public = effective_attributes({"tags": ["internal"]}, {"region": "eu"})
    insider = effective_attributes({}, {"tags": ["internal"]})
    assert matches("tags=internal", public)  # a plain clause sees what a device says
    assert not matches("@tags=internal", public)
    assert matches("@tags=internal", insider)
    # Custom keys: one spelling, bare, attested or not.
    assert matches("@tier=gold", effective_attributes({}, {"custom": {"tier": "gold"}}))
    assert not matches("@tier=gold", effective_attributes({"custom": {"tier": "gold"}}, {}))


@pytest.mark.parametrize("version", ["abc", "5.x", "5..2", "", "v5", "5.2-beta", "-1", " 5"])
@pytest.mark.parametrize(
    "text",
    ["app_version=5", "app_version!=5", "app_version<99", "app_version>=0", "app_version in (5)",
     "app_version not in (5)"],
)  # fmt: skip
def test_a_non_numeric_device_version_matches_no_version_clause(version, text):
    assert not matches(text, {"app_version": version})


def test_glob_on_a_non_numeric_device_version_still_globs_the_raw_string():
    assert matches("app_version~5.2-*", {"app_version": "5.2-beta"})


# -- versions ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5", (5,)),
        ("5.10", (5, 10)),
        ("5.2.0", (5, 2)),
        ("5.02", (5, 2)),
        ("0", ()),
        ("0.0.0", ()),
        ("14.0.1", (14, 0, 1)),
        ("1." + "0" * 30 + "1", (1, 1)),
        ("", None),
        ("5.", None),
        (".5", None),
        ("5..1", None),
        ("5.x", None),
        ("-1", None),
        ("+1", None),
        (" 1", None),
        ("١.٢", None),  # Arabic-Indic digits are decimal to Python, not to us
        ("²", None),
        ("9" * 5000, None),
        (5, None),
        (None, None),
    ],
)
def test_parse_version(text, expected):
    assert parse_version(text) == expected


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        ("5.10", "5.9", 1),
        ("5.9", "5.10", -1),
        ("5.2", "5.2.0", 0),
        ("5.2.0.0", "5.2", 0),
        ("14", "14.0.1", -1),
        ("14.0.1", "14", 1),
        ("14.0", "14", 0),
        ("1.10.0", "1.9.9", 1),
        ("0", "0.0", 0),
        ("0.0.1", "0", 1),
        ("2", "10", -1),
    ],
)
def test_compare_versions(a, b, expected):
    assert compare_versions(a, b) == expected


def test_compare_versions_rejects_non_versions():
    with pytest.raises(errors.InvalidArgument, match="'5.x' is not a version"):
        compare_versions("5.1", "5.x")
    with pytest.raises(errors.InvalidArgument, match="'beta' is not a version"):
        compare_versions("beta", "5")
