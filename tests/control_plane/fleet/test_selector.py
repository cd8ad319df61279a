"""The selector language: syntax, typed semantics, errors, and a reference evaluator."""

from __future__ import annotations

import dataclasses
import fnmatch
import operator
import pickle
import re
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from control_plane import errors
from control_plane.fleet import _selector_compile as compile_module
from control_plane.fleet import selector as selector_module
from control_plane.fleet.attributes import normalize_attributes
from control_plane.fleet.selector import (
    Clause,
    Selector,
    SelectorError,
    compare_versions,
    parse_selector,
    parse_version,
)

PIXEL = normalize_attributes(
    {
        "platform": "android",
        "os_version": "14",
        "app_version": "5.10.0",
        "device_model": "Pixel 8 Pro",
        "soc": "tensor_g3",
        "ram_mb": 12288,
        "region": "eu",
        "tags": ["beta", "dogfood"],
        "custom": {"batch": "8", "tier": "gold", "ratio": "0.5", "build": "x86"},
    }
)
BARE = {}  # a device that reports nothing


def matches(text: str, attrs: dict) -> bool:
    return parse_selector(text).matches(attrs)


# -- the documented examples ------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        (
            "platform=android,app_version>=5.2,soc in (sm8650, sm8550)",
            "platform=android, app_version>=5.2, soc in (sm8650, sm8550)",
        ),
        ("region!=eu,tags=beta", "region!=eu, tags=beta"),
        ("device_model~Pixel*", "device_model~Pixel*"),
        ("os_version>=14, ram_mb>4096", "os_version>=14, ram_mb>4096"),
    ],
)
def test_examples_parse_to_canonical_text(text, canonical):
    selector = parse_selector(text)
    assert str(selector) == canonical
    assert selector.text == text
    assert parse_selector(canonical) == selector


def test_examples_match_as_documented():
    sm8650 = {"platform": "android", "app_version": "5.2.0", "soc": "sm8650"}
    first = parse_selector("platform=android,app_version>=5.2,soc in (sm8650, sm8550)")
    assert first.matches(sm8650)
    assert not first.matches({**sm8650, "app_version": "5.1.9"})
    assert not first.matches({**sm8650, "soc": "tensor_g3"})
    assert not first.matches({**sm8650, "platform": "ios"})
    assert matches("region!=eu,tags=beta", {"region": "us", "tags": ["beta"]})
    assert not matches("region!=eu,tags=beta", {"region": "eu", "tags": ["beta"]})
    assert matches("device_model~Pixel*", PIXEL)
    assert not matches("device_model~Pixel*", {"device_model": "SM-S928B"})
    assert matches("os_version>=14, ram_mb>4096", PIXEL)
    assert not matches("os_version>=14, ram_mb>4096", {**PIXEL, "ram_mb": 4096})


def test_clauses_and_keys():
    selector = parse_selector('soc not in (a, "b c"), batch>=8, soc=x')
    assert selector.clauses == (
        Clause("soc", "not in", ("a", "b c")),
        Clause("batch", ">=", ("8",)),
        Clause("soc", "=", ("x",)),
    )
    assert selector.keys() == frozenset({"soc", "batch"})


@pytest.mark.parametrize("text", ["", " ", " \t\r\n "])
def test_empty_selector_matches_the_whole_fleet(text):
    selector = parse_selector(text)
    assert selector.clauses == ()
    assert selector.matches(PIXEL)
    assert selector.matches(BARE)
    assert str(selector) == ""
    assert selector.keys() == frozenset()


def test_whitespace_around_every_token():
    selector = parse_selector("  platform =\tandroid ,\n soc  not   in ( a ,b )  ,ram_mb> 1 ")
    assert str(selector) == "platform=android, soc not in (a, b), ram_mb>1"
    assert selector.matches(PIXEL)


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


# -- quoting ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value", "canonical"),
    [
        ('device_model="Pixel 8 Pro"', "Pixel 8 Pro", 'device_model="Pixel 8 Pro"'),
        ('note="a,b"', "a,b", 'note="a,b"'),
        ('note="say \\"hi\\""', 'say "hi"', 'note="say \\"hi\\""'),
        ('note="back\\\\slash"', "back\\slash", 'note="back\\\\slash"'),
        ('note="(x)"', "(x)", 'note="(x)"'),
        ('note=""', "", 'note=""'),
        ('note="plain"', "plain", "note=plain"),
        ('note="Ünïcode"', "Ünïcode", 'note="Ünïcode"'),
        ("note=a/b:c+d[e]?*", "a/b:c+d[e]?*", "note=a/b:c+d[e]?*"),
    ],
)
def test_quoted_values(text, value, canonical):
    selector = parse_selector(text)
    key = text.split("=")[0]
    assert selector.clauses == (Clause(key, "=", (value,)),)
    assert str(selector) == canonical
    assert parse_selector(canonical).clauses == selector.clauses


def test_quoted_values_match():
    assert matches('device_model in ("Pixel 8 Pro", "a,b")', PIXEL)
    assert matches('note="a, \\"b\\""', {"custom": {"note": 'a, "b"'}})
    assert matches('note!=""', {"custom": {"note": "x"}})
    assert not matches('note=""', {"custom": {"note": "x"}})


def test_clause_str_quotes_only_when_needed():
    assert str(Clause("soc", "in", ("a", "b c", ""))) == 'soc in (a, "b c", "")'
    assert str(Clause("soc", "not in", ("a",))) == "soc not in (a)"
    assert str(Clause("x", ">=", ("1.5",))) == "x>=1.5"
    assert str(Clause("x", "~", ('a"b',))) == 'x~"a\\"b"'


# -- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "position", "reason"),
    [
        ("platform==android", 9, "unexpected '='"),
        ("platform!==android", 10, "unexpected '='"),
        ("app_version>=abc", 13, "'abc' is not a version"),
        ("os_version in (14, 14.x)", 19, "'14.x' is not a version"),
        ("ram_mb>lots", 7, "'lots' is not a number"),
        ("ram_mb in (1, inf)", 14, "'inf' is not a number"),
        ("ram_mb=nan", 7, "'nan' is not a number"),
        ("ram_mb<1e400", 7, "'1e400' is not a number"),
        ("soc in (a, b", 12, "missing ')' to close the list opened at position 7"),
        ("soc in (a b)", 10, "expected ',' or ')' in the list, found 'b'"),
        ("soc in ()", 8, "missing value in the list"),
        ("soc in (a,)", 10, "missing value in the list"),
        ("soc in a", 7, "expected '(' after 'in'"),
        ("soc not of (a)", 8, "expected 'in' after 'not'"),
        ("platform=", 9, "missing value after '='"),
        ("platform= ,soc=a", 10, "missing value after '='"),
        (",platform=x", 0, "empty clause"),
        ("a=1,,b=2", 4, "empty clause"),
        ("platform=x,", 10, "trailing ','"),
        ("platform=x , ", 11, "trailing ','"),
        ("tags>3", 4, "operator '>' cannot be used on 'tags'"),
        ("tags<=a", 4, "operator '<=' cannot be used on 'tags'"),
        ("platform<a", 8, "operator '<' cannot be used on 'platform', which compares as text"),
        ("region >= eu", 7, "operator '>=' cannot be used on 'region'"),
        ("ram_mb~4*", 6, "operator '~' cannot be used on 'ram_mb'"),
        ("batch>=lots", 7, "'lots' is not a number (ordering operators on a custom key"),
        ('"unterminated', 0, "unterminated string"),
        ('platform="unterminated', 9, "unterminated string"),
        ('platform="ends in backslash\\', 9, "unterminated string"),
        ('"platform"=x', 0, "keys are not quoted"),
        ('note="a\\nb"', 7, "unknown escape '\\\\n'"),
        ('note="a\nb"', 7, "control character"),
        ("platform=>x", 8, "unknown operator '=>'"),
        ("platform<>x", 8, "unknown operator '<>'"),
        ("platform!x", 8, "unknown operator '!'"),
        ("platform=~x", 8, "unknown operator '=~'"),
        ("plat$form=x", 4, "'$' is not allowed in a key"),
        ("plat/form=x", 4, "'/' is not allowed in a key"),
        ("9lives=1", 0, "a key must start with a letter or '_'"),
        ("-x=1", 0, "a key must start with a letter or '_'"),
        ("(x=1)", 0, "expected a key, found '('"),
        ("platform", 8, "missing operator after key 'platform'"),
        ("platform,soc=a", 8, "missing operator after key 'platform'"),
        ("platform is android", 9, "expected an operator"),
        ("platform=android soc=x", 17, "expected ',' between clauses, found 's'"),
        ("platform=android)", 16, "expected ',' between clauses, found ')'"),
        ("platform=and$roid", 12, "'$' is not allowed in an unquoted value"),
        ("platform=(x)", 9, "unexpected '(' where a value should be"),
        ('platform="a"b', 12, "expected ',' between clauses"),
    ],
)
def test_error_positions_and_reasons(text, position, reason):
    with pytest.raises(SelectorError) as caught:
        parse_selector(text)
    assert caught.value.position == position
    assert reason in caught.value.reason


def test_error_message_is_one_line_with_position_reason_and_snippet():
    with pytest.raises(SelectorError) as caught:
        parse_selector("platform==android")
    assert str(caught.value) == (
        "invalid selector at position 9: unexpected '=' (equality is a single '=')"
        " (near 'platform==android')"
    )
    assert isinstance(caught.value, errors.InvalidArgument)


def test_error_snippet_is_a_window_around_the_position_and_stays_one_line():
    text = "region=eu,\nplatform=android,\nsoc in (a,\n b"
    with pytest.raises(SelectorError) as caught:
        parse_selector(text)
    message = str(caught.value)
    assert "\n" not in message
    assert message.endswith(f"(near {text[-10:]!r})")
    assert caught.value.position == len(text)


def test_the_first_error_in_text_order_wins():
    # The type error on `tags` comes before the syntax error at the end.
    with pytest.raises(SelectorError) as caught:
        parse_selector("tags>3, platform==x")
    assert caught.value.position == 4


def test_length_limit():
    value = "x" * (4096 - len("note="))
    assert parse_selector("note=" + value).clauses[0].values == (value,)
    with pytest.raises(SelectorError) as caught:
        parse_selector("note=" + value + "x")
    assert caught.value.position == 4096
    assert "longer than 4096 characters" in caught.value.reason


def test_dense_selectors_whose_canonical_text_would_not_reparse_are_refused():
    dense = "soc in(" + ",".join("a" * 256) + ")"  # 519 chars; str() adds 256 spaces
    five = parse_selector(",".join([dense] * 5))
    assert len(str(five)) == 5 * 775 + 4 * 2 <= 4096
    assert parse_selector(str(five)) == five
    seven = ",".join([dense] * 7)
    assert len(seven) <= 4096
    with pytest.raises(SelectorError, match="longer than 4096 characters once normalized") as e:
        parse_selector(seven)
    assert e.value.position == 5 * (519 + 1)  # the sixth clause crosses the limit


def test_clause_limit():
    sixty_four = ",".join(f"k{i}=1" for i in range(64))
    assert len(parse_selector(sixty_four).clauses) == 64
    with pytest.raises(SelectorError, match="more than 64 clauses") as caught:
        parse_selector(sixty_four + ",k64=1")
    assert caught.value.position == len(sixty_four) + 1


def test_list_limit():
    values = [f"v{i}" for i in range(256)]
    text = f"soc in ({', '.join(values)})"
    assert len(parse_selector(text).clauses[0].values) == 256
    long_text = f"soc in ({', '.join(values)}, extra)"
    with pytest.raises(SelectorError, match="more than 256 values") as caught:
        parse_selector(long_text)
    assert caught.value.position == long_text.index("extra")


# -- the Selector object ----------------------------------------------------------------


def test_equality_and_hash_follow_the_canonical_text():
    a = parse_selector("platform = android,soc in(a,b)")
    b = parse_selector('platform="android", soc in ("a", b)')
    c = parse_selector("soc in (a, b), platform=android")
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert a.text != b.text
    assert len({a, b, c}) == 2
    assert a != "platform=android, soc in (a, b)"


def test_selector_is_immutable():
    selector = parse_selector("platform=android")
    with pytest.raises(dataclasses.FrozenInstanceError):
        selector.text = "platform=ios"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        selector.clauses[0].key = "soc"  # type: ignore[misc]


def test_selector_pickles_by_text_and_repr_shows_the_canonical_text():
    selector = parse_selector("platform = android, tags~be*")
    copy = pickle.loads(pickle.dumps(selector))
    assert copy == selector and copy.text == selector.text
    assert copy.matches(PIXEL)
    assert repr(selector) == "Selector('platform=android, tags~be*')"


def test_matches_parses_and_compiles_nothing(monkeypatch):
    selector = parse_selector(
        "platform=android, app_version>=5.2, device_model~Pixel*, tags~be*, batch>=8,"
        " tier in (gold, 8), os_version!=13"
    )

    def forbidden(*args, **kwargs):
        raise AssertionError("matches() must not parse or compile")

    monkeypatch.setattr(re, "compile", forbidden)
    monkeypatch.setattr(fnmatch, "fnmatchcase", forbidden)
    monkeypatch.setattr(fnmatch, "translate", forbidden)
    monkeypatch.setattr(selector_module, "_Parser", forbidden)
    monkeypatch.setattr(selector_module, "parse_version", forbidden)
    monkeypatch.setattr(compile_module, "parse_version", forbidden)
    monkeypatch.setattr(compile_module, "_parse_number", forbidden)
    assert selector.matches(PIXEL)
    assert not selector.matches({**PIXEL, "app_version": "5.1"})


def test_device_side_caches_are_bounded():
    assert selector_module._device_version.cache_info().maxsize == 4096
    assert selector_module._device_number.cache_info().maxsize == 4096


# -- properties: round trip, and a reference evaluator ----------------------------------

VERSION_KEYS = ("os_version", "app_version")
TEXT_KEYS = ("platform", "device_model", "soc", "region")
CUSTOM_KEYS = ("batch", "tier", "k.x-1", "absent")
VERSIONS = ["0", "5", "5.0", "5.2", "5.2.0", "5.9", "5.10", "14", "14.0.1"]
DEVICE_VERSIONS = [*VERSIONS, "abc", "5.2-beta"]
NUMBERS = ["8", "8.0", "08", "-3", ".5", "0.5", "1e1", "10", "4096"]
WORDS = ["android", "gold", "a,b", "Pixel 8 Pro", 'q"t', "b\\s", "8x", "", "tensor_g3"]
GLOBS = ["A*", "a*", "pixel*", "G*", "*", "*8*", "?", "5.*", "Pixel*", "[ab]*", "g?ld", "*[!x]"]
TAGS = ["beta", "dogfood", "canary", "a:b", "1.0"]

_ops_eq = st.sampled_from(["=", "!=", "in", "not in"])
_ops_all = st.sampled_from(["=", "!=", "<", "<=", ">", ">=", "~", "in", "not in"])


def _values(op: str, pool: list[str], glob_pool: list[str] = GLOBS) -> st.SearchStrategy:
    if op == "~":
        return st.tuples(st.sampled_from(glob_pool))
    if op in ("in", "not in"):
        return st.lists(st.sampled_from(pool), min_size=1, max_size=4).map(tuple)
    return st.tuples(st.sampled_from(pool))


@st.composite
def clauses(draw, free_text: bool = False) -> Clause:
    kind = draw(st.sampled_from(["version", "text", "ram", "custom", "tags"]))
    words = st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=12)
    if kind == "version":
        key, op = draw(st.sampled_from(VERSION_KEYS)), draw(_ops_all)
        return Clause(key, op, draw(_values(op, VERSIONS)))
    if kind == "ram":
        op = draw(st.sampled_from(["=", "!=", "<", "<=", ">", ">=", "in", "not in"]))
        return Clause("ram_mb", op, draw(_values(op, NUMBERS)))
    if kind == "tags":
        op = draw(st.sampled_from(["=", "!=", "~", "in", "not in"]))
        return Clause("tags", op, draw(_values(op, TAGS)))
    pool = [draw(words) for _ in range(3)] if free_text else WORDS + NUMBERS
    if kind == "text":
        op = draw(st.sampled_from(["=", "!=", "~", "in", "not in"]))
        return Clause(draw(st.sampled_from(TEXT_KEYS)), op, draw(_values(op, pool)))
    op = draw(_ops_all)
    pool = NUMBERS if op in ("<", "<=", ">", ">=") else pool
    return Clause(draw(st.sampled_from(CUSTOM_KEYS)), op, draw(_values(op, pool)))


_space = st.sampled_from(["", " ", "  ", "\t", "\n"])


@st.composite
def selector_texts(draw, free_text: bool = False) -> tuple[str, list[Clause]]:
    """Write clauses the way a person might: random spacing, quotes where optional."""
    made = draw(st.lists(clauses(free_text), max_size=5))

    def value(text: str) -> str:
        bare = re.fullmatch(r"[A-Za-z0-9._\-*?:/+\[\]]+", text)
        if bare and not draw(st.booleans()):
            return text
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'

    def clause(c: Clause) -> str:
        s = [draw(_space) for _ in range(4)]
        if c.op in ("in", "not in"):
            op = c.op.replace(" ", " " + draw(_space))
            inner = ",".join(f"{draw(_space)}{value(v)}{draw(_space)}" for v in c.values)
            return f"{s[0]}{c.key} {s[1]}{op} {s[2]}({inner}){s[3]}"
        return f"{s[0]}{c.key}{s[1]}{c.op}{s[2]}{value(c.values[0])}{s[3]}"

    return ",".join(clause(c) for c in made), made


@given(selector_texts(free_text=True))
@settings(max_examples=300)
def test_round_trip_through_canonical_text(case):
    text, made = case
    selector = parse_selector(text)
    assert list(selector.clauses) == made
    again = parse_selector(str(selector))
    assert again.clauses == selector.clauses
    assert again == selector
    assert str(again) == str(selector)


_REF_NUMBER = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_REF_KINDS = {"os_version": "version", "app_version": "version", "ram_mb": "ram", "tags": "tags"}
_REF_ORDER = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_REF_KINDS |= dict.fromkeys(("platform", "device_model", "soc", "region"), "text")


def _ref_version(text: object) -> list[int] | None:
    if not isinstance(text, str) or not re.fullmatch(r"[0-9]+(\.[0-9]+)*", text):
        return None
    return [int(part) for part in text.split(".")]


def _ref_number(text: object) -> Fraction | None:
    if isinstance(text, int):
        return Fraction(text)
    if isinstance(text, str) and _REF_NUMBER.fullmatch(text):
        return Fraction(text)
    return None


def _ref_sign(kind: str, device: object, constant: str) -> int | None:
    """Return the sign of device - constant, or None when they do not compare."""
    if kind == "version":
        a, b = _ref_version(device), _ref_version(constant)
        if a is None:
            return None
        width = max(len(a), len(b))  # pad with zeros rather than strip them
        a, b = a + [0] * (width - len(a)), b + [0] * (width - len(b))
    else:
        a, b = _ref_number(device), _ref_number(constant)
        if a is None or b is None:
            return None
    return (a > b) - (a < b)


def _ref_equal(kind: str, device: object, constant: str) -> bool | None:
    """Equality, or None for a device value that cannot be compared at all."""
    if kind == "text":
        return device == constant
    sign = _ref_sign(kind, device, constant)
    if sign is None:
        return device == constant if kind == "custom" else None
    return sign == 0


def _ref_tags(op: str, values: tuple[str, ...], tags: list[str]) -> bool:
    if op == "~":
        return any(fnmatch.fnmatchcase(tag, values[0]) for tag in tags)
    found = any(value in tags for value in values)
    return found if op in ("=", "in") else not found


def _ref_clause(c: Clause, attrs: dict) -> bool:
    kind = _REF_KINDS.get(c.key, "custom")
    where = attrs.get("custom", {}) if kind == "custom" else attrs
    if c.key not in where:
        return False
    device = where[c.key]
    if kind == "tags":
        return _ref_tags(c.op, c.values, device)
    if c.op == "~":
        return fnmatch.fnmatchcase(device, c.values[0])
    if c.op in ("<", "<=", ">", ">="):
        sign = _ref_sign(kind, device, c.values[0])
        return sign is not None and _REF_ORDER[c.op](sign, 0)
    equal = [_ref_equal(kind, device, value) for value in c.values]
    if None in equal:
        return False
    return any(equal) == (c.op in ("=", "in"))


def reference_matches(made: list[Clause], attrs: dict) -> bool:
    """A deliberately plain evaluator written from the spec, sharing no code with the module."""
    return all(_ref_clause(c, attrs) for c in made)


_devices = st.fixed_dictionaries(
    {},
    optional={
        "platform": st.sampled_from([*WORDS[:-2], "8"]),
        "os_version": st.sampled_from(DEVICE_VERSIONS),
        "app_version": st.sampled_from(DEVICE_VERSIONS),
        "device_model": st.sampled_from(["Pixel 8 Pro", "Pixel 7", "a,b", "android"]),
        "soc": st.sampled_from(["tensor_g3", "sm8650", "a1", "8"]),
        "region": st.sampled_from(["eu", "us", ""]),
        "ram_mb": st.sampled_from([0, 8, 10, 4096, 4097]),
        "tags": st.lists(st.sampled_from(TAGS), max_size=3),
        "custom": st.dictionaries(
            st.sampled_from(CUSTOM_KEYS[:-1]),
            st.sampled_from([*NUMBERS, *WORDS[:-2], "1e", "1.2.3", "nan"]),
            min_size=1,
            max_size=3,
        ),
    },
).map(normalize_attributes)


def _near(value: str) -> st.SearchStrategy[str]:
    """Values at the edge of `value`: itself, other case, trailing zero, prefix, no globs."""
    unglobbed = value.replace("*", "x").replace("?", "y").replace("[", "").replace("]", "")
    variants = [value, value.upper(), value.lower(), value + ".0", value + "1", "0" + value]
    return st.sampled_from([*variants, value[:-1], unglobbed])


def _steer(device: dict, made: list[Clause], data: st.DataObject) -> dict:
    """Copy `device`, setting some clause keys near that clause's constants.

    Independent random devices rarely hit a constant exactly; these do, so the edges
    (equal versions, case, numeric text) are exercised on every run.
    """
    attrs = {**device, "custom": dict(device.get("custom", {}))}
    for clause in made:
        if not data.draw(st.booleans()):
            continue
        value = data.draw(_near(data.draw(st.sampled_from(clause.values))))
        kind = _REF_KINDS.get(clause.key, "custom")
        if kind == "tags":
            attrs["tags"] = [*attrs.get("tags", []), value]
        elif kind == "ram":
            number = _ref_number(value)
            if number is not None and number.denominator == 1 and 0 <= number <= 2**31:
                attrs["ram_mb"] = int(number)
        else:
            (attrs["custom"] if kind == "custom" else attrs)[clause.key] = value
    try:
        return normalize_attributes(attrs)
    except errors.InvalidArgument:  # e.g. a tag that no device could report
        return device


@given(selector_texts(), _devices, st.data())
# Each example draws a few dozen small choices; a loaded CI box can trip too_slow.
# No deadline: a busy CI machine must not turn a slow example into a failure.
@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_matches_agrees_with_the_reference_evaluator(case, device, data):
    text, made = case
    selector = parse_selector(text)
    for attrs in (device, _steer(device, made, data), _steer(device, made, data)):
        assert selector.matches(attrs) is reference_matches(made, attrs), (str(selector), attrs)
        # Clause by clause too, so one failing clause cannot hide another's bug.
        for clause in made:
            one = parse_selector(str(clause))
            assert one.matches(attrs) is _ref_clause(clause, attrs), (str(clause), attrs)


def test_reference_evaluator_sanity():
    # Guards the property above against a reference that agrees by saying False everywhere.
    made = list(parse_selector("app_version>=5.2, tier in (8, gold), tags not in (canary)").clauses)
    assert reference_matches(made, PIXEL)
    assert not reference_matches(made, {**PIXEL, "app_version": "5.1"})
    assert not reference_matches(made, BARE)


def test_selector_type_is_exported():
    assert isinstance(parse_selector(""), Selector)
