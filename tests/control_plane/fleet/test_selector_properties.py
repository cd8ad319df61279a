"""The selector language: round trip through canonical text, a reference evaluator, `@`."""

from __future__ import annotations

import fnmatch
import operator
import re
from dataclasses import replace
from fractions import Fraction

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from contract import errors
from control_plane.fleet.attributes import effective_attributes, normalize_attributes
from control_plane.fleet.selector import Clause, parse_selector
from tests.control_plane.fleet._selector_cases import BARE, PIXEL

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
def clauses(draw, free_text: bool = False, attested: bool | None = None) -> Clause:
    """A clause on any kind of key; `@` (attested) one time in four unless `attested`."""
    if attested is None:
        attested = draw(st.sampled_from([False, False, False, True]))
    return replace(draw(_plain_clauses(free_text)), attested=attested)


@st.composite
def _plain_clauses(draw, free_text: bool = False) -> Clause:
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
    # Custom attributes are written custom.NAME, the one spelling.
    return Clause("custom." + draw(st.sampled_from(CUSTOM_KEYS)), op, draw(_values(op, pool)))


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
        key = "@" + c.key if c.attested else c.key
        if c.op in ("in", "not in"):
            op = c.op.replace(" ", " " + draw(_space))
            inner = ",".join(f"{draw(_space)}{value(v)}{draw(_space)}" for v in c.values)
            return f"{s[0]}{key} {s[1]}{op} {s[2]}({inner}){s[3]}"
        return f"{s[0]}{key}{s[1]}{c.op}{s[2]}{value(c.values[0])}{s[3]}"

    return ",".join(clause(c) for c in made), made


@given(selector_texts(free_text=True))
@settings(max_examples=300)
def test_round_trip_through_canonical_text(case):
    text, made = case
    selector = parse_selector(text, strict=True)  # as operators' selectors are read
    assert list(selector.clauses) == made
    again = parse_selector(str(selector), strict=True)
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
    if c.attested:  # the same clause, over what the enrollment token stamped only
        attrs = attrs.get("attested", {})
    where = attrs.get("custom", {}) if kind == "custom" else attrs
    key = c.key.removeprefix("custom.") if kind == "custom" else c.key
    if key not in where:
        return False
    device = where[key]
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
            if kind == "custom":
                attrs["custom"][clause.key.removeprefix("custom.")] = value
            else:
                attrs[clause.key] = value
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
    made = list(
        parse_selector("app_version>=5.2, custom.tier in (8, gold), tags not in (canary)").clauses
    )
    assert reference_matches(made, PIXEL)
    assert not reference_matches(made, {**PIXEL, "app_version": "5.1"})
    assert not reference_matches(made, BARE)


# -- `@` clauses: attested values only --------------------------------------------------


@given(selector_texts(), _devices, _devices, st.data())
@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_matches_agrees_with_the_reference_on_stamped_devices(case, reported, stamped, data):
    text, made = case
    selector = parse_selector(text)
    reported, stamped = _steer(reported, made, data), _steer(stamped, made, data)
    attrs = effective_attributes(reported, stamped)
    assert selector.matches(attrs) is reference_matches(made, attrs), (str(selector), attrs)
    for clause in made:
        one = parse_selector(str(clause))
        assert one.matches(attrs) is _ref_clause(clause, attrs), (str(clause), attrs)


@given(clauses(attested=False), _devices, _devices, _devices, st.data())
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_attested_clauses_never_match_unattested_values(clause, reported, other, stamped, data):
    attested = parse_selector(str(replace(clause, attested=True)))
    plain = parse_selector(str(clause))
    # Steered so that the plain clause often matches what the device reports.
    reported = _steer(reported, [clause], data)
    stamped = _steer(stamped, [clause], data)
    # Whatever a device reports, without a stamp no `@` clause matches it.
    assert not attested.matches(reported)
    assert not attested.matches(effective_attributes(reported, {}))
    # With one, the `@` clause is the plain clause on the stamp alone: what the device
    # reports neither adds to nor changes its answer.
    outcome = attested.matches(effective_attributes(reported, stamped))
    assert outcome is plain.matches(_stamp(stamped))
    assert outcome is attested.matches(effective_attributes(other, stamped))
    # A value the device claims and the token did not stamp never makes `@` match.
    assert not attested.matches(effective_attributes(reported, _without(stamped, clause.key)))


def _stamp(stamped: dict) -> dict:
    """What a canonical stamp attests: all of it, but an empty tag list is no stamp."""
    return {k: v for k, v in stamped.items() if (k, v) != ("tags", [])}


def _without(attrs: dict, key: str) -> dict:
    """Return canonical `attrs` without `key` (a custom key is looked for under custom)."""
    name = key.removeprefix("custom.")
    custom = {k: v for k, v in attrs.get("custom", {}).items() if k != name}
    rest = {k: v for k, v in attrs.items() if k not in (key, "custom")}
    return normalize_attributes({**rest, "custom": custom})


def test_attested_properties_are_not_vacuous():
    # Guards the properties above against an evaluator where `@` never matches at all.
    stamped = normalize_attributes({"tags": ["beta"], "custom": {"tier": "gold"}})
    for text in ("@tags=beta", "@custom.tier=gold", "@tags not in (x)"):
        assert parse_selector(text).matches(effective_attributes({"tags": ["x"]}, stamped))
