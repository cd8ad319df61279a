"""Clause compilation for `control_plane.fleet.selector`: one closure per parsed clause.

Each clause is type-checked against its key's kind and turned into a test over canonical
device attributes, with its constants converted and its pattern compiled here, once. The
closures only look up, convert device-side strings through bounded caches, and compare.
"""

from __future__ import annotations

import fnmatch
import functools
import math
import operator
import re
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, NoReturn

from contract import errors
from control_plane.fleet.attributes import ATTESTED, CUSTOM, STANDARD_KEYS

if TYPE_CHECKING:
    from control_plane.fleet.selector import Clause

_ORDERING = frozenset({"<", "<=", ">", ">="})
# functools.partial binds the constant as the LEFT operand, hence the mirrored operators.
_MIRRORED = {
    "=": operator.eq,
    "!=": operator.ne,
    "<": operator.gt,
    "<=": operator.ge,
    ">": operator.lt,
    ">=": operator.le,
}
_GLOB_CHARS = frozenset("*?[")
_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
_KINDS = {key: "text" for key in STANDARD_KEYS} | {
    "os_version": "version",
    "app_version": "version",
    "ram_mb": "number",
    "tags": "tags",
}
# Operators each kind refuses, and the phrase that says why.
_REFUSED = {
    "text": (_ORDERING, "compares as text"),
    "tags": (_ORDERING, "is a set of tags"),
    "number": (frozenset({"~"}), "compares as a number"),
}
# How a clause names a custom attribute: `custom.tier` (the device-class setting's spelling).
CUSTOM_PREFIX = CUSTOM + "."
_NO_CUSTOM: Mapping[str, str] = MappingProxyType({})
_NOTHING_ATTESTED: Mapping[str, object] = MappingProxyType({})

Test = Callable[[Mapping], object]
Fail = Callable[[str, int], NoReturn]


def parse_version(text: object) -> tuple[int, ...] | None:
    """Return dot-separated non-negative integers without trailing zeros, or None.

    Dropping trailing zeros makes 5.2 equal 5.2.0 and lets tuple order be version order.
    """
    if not isinstance(text, str) or not text:
        return None
    parts = text.split(".")
    if not all(part.isascii() and part.isdecimal() for part in parts):
        return None
    try:
        numbers = [int(part) for part in parts]
    except ValueError:  # more digits than int() agrees to convert
        return None
    while numbers and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


def compare_versions(a: str, b: str) -> int:
    """Return -1, 0 or 1 as version `a` is below, equal to or above `b`."""
    left, right = parse_version(a), parse_version(b)
    if left is None or right is None:
        bad = a if left is None else b
        raise errors.InvalidArgument(f"{bad!r:.80} is not a version (like 5.2.1)")
    return (left > right) - (left < right)


def _parse_number(text: object) -> int | float | None:
    if not isinstance(text, str) or not _NUMBER.fullmatch(text):
        return None
    try:
        number = int(text) if text.lstrip("+-").isdecimal() else float(text)
    except ValueError:  # more digits than int() agrees to convert
        return None
    if isinstance(number, float) and not math.isfinite(number):
        return None
    return number


# Only device-side strings go through these; the selector's constants are converted once.
_device_version = functools.lru_cache(maxsize=4096)(parse_version)
_device_number = functools.lru_cache(maxsize=4096)(_parse_number)


def _compile(clause: Clause, op_pos: int, positions: tuple[int, ...], fail: Fail) -> Test:
    test = _compile_plain(clause, op_pos, positions, fail)
    return _attested(test) if clause.attested else test


def _attested(test: Test) -> Test:
    # The attested part has the canonical shape too, so the plain test runs on it as is;
    # a device with nothing attested gets an empty mapping, where every clause fails.
    def attested_test(attrs: Mapping) -> object:
        return test(attrs.get(ATTESTED, _NOTHING_ATTESTED))

    return attested_test


def _compile_plain(clause: Clause, op_pos: int, positions: tuple[int, ...], fail: Fail) -> Test:
    key, op = clause.key, clause.op
    # The parser hands over standard keys and `custom.NAME` only.
    kind = "custom" if key.startswith(CUSTOM_PREFIX) else _KINDS[key]
    refused, because = _REFUSED.get(kind, ((), ""))
    if op in refused:
        fail(f"operator {op!r} cannot be used on {key!r}, which {because}", op_pos)
    if kind == "tags":
        return _standard(key, _tags_predicate(op, clause.values))
    if kind == "custom":
        name = key[len(CUSTOM_PREFIX) :]
        return _custom(name, _custom_predicate(op, clause.values, positions, fail))
    if op == "~":
        return _standard(key, _glob(clause.values[0]))
    if kind == "text":
        return _standard(key, _predicate(op, clause.values))
    if kind == "number":
        numbers = _constants(clause.values, positions, _parse_number, "a number", fail)
        return _standard(key, _predicate(op, numbers))
    what = "a version (dot-separated non-negative integers like 5.2.1)"
    versions = _constants(clause.values, positions, parse_version, what, fail)
    return _standard_version(key, _predicate(op, versions))


def _constants(
    values: tuple[str, ...],
    positions: tuple[int, ...],
    convert: Callable[[str], object],
    what: str,
    fail: Fail,
) -> tuple:
    converted = []
    for value, position in zip(values, positions, strict=True):
        if (result := convert(value)) is None:
            fail(f"{value!r:.80} is not {what}", position)
        converted.append(result)
    return tuple(converted)


def _predicate(op: str, wants: tuple) -> Callable[[object], object]:
    if op == "in":
        return frozenset(wants).__contains__
    if op == "not in":
        members = frozenset(wants)
        return lambda value: value not in members
    return functools.partial(_MIRRORED[op], wants[0])


def _glob(pattern: str) -> Callable[[str], object]:
    if _GLOB_CHARS.isdisjoint(pattern):
        return functools.partial(operator.eq, pattern)
    # What fnmatch.fnmatchcase does, minus its per-call cache lookup.
    return re.compile(fnmatch.translate(pattern)).match


def _converted(convert: Callable, predicate: Callable) -> Callable[[object], bool]:
    def test(raw: object) -> bool:
        value = convert(raw)
        return value is not None and predicate(value)

    return test


def _tags_predicate(op: str, values: tuple[str, ...]) -> Callable[[list], object]:
    if op == "~":
        glob = _glob(values[0])
        return lambda tags: any(map(glob, tags))
    members = frozenset(values)
    if op == "not in":
        return members.isdisjoint
    if op == "in":
        return lambda tags: not members.isdisjoint(tags)
    want = values[0]
    if op == "=":
        return lambda tags: want in tags
    return lambda tags: want not in tags


def _custom_predicate(
    op: str, values: tuple[str, ...], positions: tuple[int, ...], fail: Fail
) -> Callable[[object], object]:
    if op == "~":
        return _glob(values[0])
    if op in _ORDERING:
        what = "a number (ordering operators on a custom key need one)"
        numbers = _constants(values, positions, _parse_number, what, fail)
        return _converted(_device_number, _predicate(op, numbers))
    equal = _text_or_number_equal(values)
    return equal if op in ("=", "in") else (lambda raw: not equal(raw))


def _text_or_number_equal(values: tuple[str, ...]) -> Callable[[object], bool]:
    """Compare as numbers when both sides read as numbers (8 = "8.0"), else as text."""
    numbers = [_parse_number(value) for value in values]
    texts = frozenset(v for v, n in zip(values, numbers, strict=True) if n is None)
    wanted = frozenset(n for n in numbers if n is not None)
    if not wanted:
        return texts.__contains__

    def equal(raw: object) -> bool:
        if raw in texts:
            return True
        number = _device_number(raw)
        return number is not None and number in wanted

    return equal


def _standard(key: str, predicate: Callable[[object], object]) -> Test:
    def test(attrs: Mapping) -> object:
        value = attrs.get(key)
        return value is not None and predicate(value)

    return test


def _standard_version(key: str, predicate: Callable[[object], object]) -> Test:
    # _standard over _converted, fused: version clauses are the commonest, one call less.
    def test(attrs: Mapping) -> object:
        raw = attrs.get(key)
        if raw is None:
            return False
        value = _device_version(raw)
        return value is not None and predicate(value)

    return test


def _custom(key: str, predicate: Callable[[object], object]) -> Test:
    def test(attrs: Mapping) -> object:
        value = attrs.get(CUSTOM, _NO_CUSTOM).get(key)
        return value is not None and predicate(value)

    return test
