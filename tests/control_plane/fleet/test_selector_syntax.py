"""The selector language: syntax, canonical text, quoting, errors, limits, the object."""

from __future__ import annotations

import dataclasses
import fnmatch
import pickle
import re

import pytest

from contract import errors
from control_plane.fleet import _selector_compile as compile_module
from control_plane.fleet import selector as selector_module
from control_plane.fleet.selector import Clause, Selector, SelectorError, parse_selector
from tests.control_plane.fleet._selector_cases import BARE, PIXEL, matches

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
        ("@tags=internal", "@tags=internal"),
        ("@region in (eu,us), platform=android", "@region in (eu, us), platform=android"),
        ("@custom.tier = gold ,@ram_mb>=4096", "@custom.tier=gold, @ram_mb>=4096"),
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
    selector = parse_selector('soc not in (a, "b c"), custom.batch>=8, soc=x')
    assert selector.clauses == (
        Clause("soc", "not in", ("a", "b c")),
        Clause("custom.batch", ">=", ("8",)),
        Clause("soc", "=", ("x",)),
    )
    assert selector.keys() == frozenset({"soc", "custom.batch"})


def test_attested_clauses_and_keys():
    selector = parse_selector(
        '@tags=internal, tags=beta, @region not in (us, "x y"), @custom.tier~g*'
    )
    assert selector.clauses == (
        Clause("tags", "=", ("internal",), attested=True),
        Clause("tags", "=", ("beta",)),
        Clause("region", "not in", ("us", "x y"), attested=True),
        Clause("custom.tier", "~", ("g*",), attested=True),
    )
    assert selector.keys() == frozenset({"tags", "region", "custom.tier"})
    # `@tags=x` and `tags=x` are different selectors (and rollouts).
    assert parse_selector("@tags=x") != parse_selector("tags=x")
    assert str(Clause("soc", "in", ("a", "b c"), attested=True)) == '@soc in (a, "b c")'


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


# -- quoting ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "value", "canonical"),
    [
        ('device_model="Pixel 8 Pro"', "Pixel 8 Pro", 'device_model="Pixel 8 Pro"'),
        ('custom.note="a,b"', "a,b", 'custom.note="a,b"'),
        ('custom.note="say \\"hi\\""', 'say "hi"', 'custom.note="say \\"hi\\""'),
        ('custom.note="back\\\\slash"', "back\\slash", 'custom.note="back\\\\slash"'),
        ('custom.note="(x)"', "(x)", 'custom.note="(x)"'),
        ('custom.note=""', "", 'custom.note=""'),
        ('custom.note="plain"', "plain", "custom.note=plain"),
        ('custom.note="Ünïcode"', "Ünïcode", 'custom.note="Ünïcode"'),
        ("custom.note=a/b:c+d[e]?*", "a/b:c+d[e]?*", "custom.note=a/b:c+d[e]?*"),
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
        ("@", 1, "expected a key right after '@'"),
        ("@ tags=x", 1, "expected a key right after '@' (as in @tags=beta), found ' '"),
        ("@@tags=x", 1, "expected a key right after '@'"),
        ("@,tags=x", 1, "expected a key right after '@'"),
        ("tags=x, @", 9, "right after '@' (as in @tags=beta), found the end"),
        ("@9lives=1", 1, "a key must start with a letter or '_'"),
        ('@"tags"=x', 1, "keys are not quoted"),
        ("tags@=x", 4, "'@' is not allowed in a key"),
        ("tags=@x", 5, "unexpected '@' where a value should be"),
        ("@tags>3", 5, "operator '>' cannot be used on 'tags'"),
        ("@region<eu", 7, "operator '<' cannot be used on 'region'"),
        ("@ram_mb~4*", 7, "operator '~' cannot be used on 'ram_mb'"),
        ("@app_version>=abc", 14, "'abc' is not a version"),
        ("@batch>lots", 7, "'lots' is not a number"),
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
    value = "x" * (4096 - len("custom.note="))
    assert parse_selector("custom.note=" + value).clauses[0].values == (value,)
    with pytest.raises(SelectorError) as caught:
        parse_selector("custom.note=" + value + "x")
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


def test_selector_type_is_exported():
    assert isinstance(parse_selector(""), Selector)


# -- one spelling for custom keys; typos refused (strict) --------------------------------


@pytest.mark.parametrize(
    ("text", "position", "reason"),
    [
        # `rollout create --select 'platfrom=android'` once made a rollout for 0 devices.
        ("platfrom=android", 0, "unknown attribute 'platfrom': did you mean `platform`?"),
        ("region=eu, sco=sm8650", 11, "did you mean `soc`?"),
        ("@regoin=eu", 1, "did you mean `region`?"),
        ("Platform=android", 0, "did you mean `platform`?"),
        ("tier=gold", 0, "for a custom attribute, write `custom.tier`"),
        ("custom=gold", 0, "a custom attribute is written `custom.NAME`"),
        ("custom.9x=1", 0, "a custom attribute is custom.NAME"),
    ],
)
def test_strict_selectors_refuse_unknown_keys_naming_the_likely_one(text, position, reason):
    with pytest.raises(SelectorError) as caught:
        parse_selector(text, strict=True)
    assert caught.value.position == position
    assert reason in caught.value.reason
    assert isinstance(caught.value, errors.InvalidArgument)


def test_custom_keys_are_written_custom_dot_key_in_every_clause():
    selector = parse_selector("custom.tier=gold, @custom.batch>=8", strict=True)
    device = {"custom": {"tier": "gold", "batch": "8"}, "attested": {"custom": {"batch": "8"}}}
    assert selector.matches(device)
    assert str(selector) == "custom.tier=gold, @custom.batch>=8"


def test_stored_selectors_with_bare_custom_keys_still_read_as_custom():
    # Rollouts stored before the custom.KEY spelling keep matching what they matched.
    old = parse_selector("tier=gold")
    assert old.matches({"custom": {"tier": "gold"}})
    assert str(old) == "custom.tier=gold"
    assert parse_selector(str(old), strict=True) == old
