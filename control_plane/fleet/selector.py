"""Rollout selectors: a small typed language over canonical device attributes.

    platform=android, app_version>=5.2, soc in (sm8650, sm8550), device_model~"Pixel 8*"

Clauses are ANDed. A selector is parsed and type-checked once, when an operator creates
or previews a rollout, and evaluated on every device Sync for every rollout, so parsing
compiles each clause into a closure over precomputed constants: `matches` runs no parser
and compiles no pattern, and device-side version and number strings go through bounded
caches (a fleet reports few distinct ones). A clause on a key the device does not report
never matches, `!=` and `not in` included: "unknown" is not "different".

A clause prefixed with `@` (`@tags=internal`, `@region in (eu, us)`, `@tier!=free`) is
the same clause over the device's attested attributes only: those its enrollment token
stamped, which the device cannot change (`fleet.attributes`, key `"attested"`). A device
without that attested key never matches it, `!=` and `not in` included, whatever it
reports.

Custom attributes are written `custom.KEY` (`custom.tier=gold`, `@custom.tier=gold`), the
spelling the device-class setting uses too, so a bare key is a standard attribute or a
typo: `parse_selector(text, strict=True)` (every selector an operator writes now: `rollout
create`, `fleet ls --select`) refuses an unknown bare key naming the closest standard one
("did you mean `platform`?"). Selectors stored before that spelling may hold bare custom
keys (`tier=gold`); read without `strict`, a bare unknown key is a custom one, as it was,
and the canonical text (`str(selector)`) writes it `custom.tier`.
"""

from __future__ import annotations

import difflib
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from contract import errors
from control_plane.fleet._selector_compile import (
    CUSTOM_PREFIX,
    Test,
    _compile,
    compare_versions,
    parse_version,
)

# Also reachable here, where they were defined before the split: tests check their bounds.
from control_plane.fleet._selector_compile import _device_number as _device_number
from control_plane.fleet._selector_compile import _device_version as _device_version
from control_plane.fleet.attributes import STANDARD_KEYS

__all__ = [
    "ATTESTED_MARK",
    "CUSTOM_PREFIX",
    "LIST_OPERATORS",
    "MAX_CLAUSES",
    "MAX_TEXT",
    "MAX_VALUES",
    "SYMBOL_OPERATORS",
    "Clause",
    "Selector",
    "SelectorError",
    "compare_versions",
    "parse_selector",
    "parse_version",
]

MAX_TEXT = 4096
MAX_CLAUSES = 64
MAX_VALUES = 256
LIST_OPERATORS = ("in", "not in")
SYMBOL_OPERATORS = ("=", "!=", "<", "<=", ">", ">=", "~")
ATTESTED_MARK = "@"
_SPACE = frozenset(" \t\r\n")
_OP_CHARS = frozenset("=!<>~")
_KEY_START = frozenset(string.ascii_letters + "_")
_KEY_CHARS = _KEY_START | frozenset(string.digits + ".-")
_BARE_CHARS = frozenset(string.ascii_letters + string.digits + "._-*?:/+[]")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_UNTERMINATED = "unterminated string (no closing '\"')"
_CUSTOM_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")


class SelectorError(errors.InvalidArgument):
    """A selector that does not parse or does not type-check, with where and why."""

    def __init__(self, text: str, position: int, reason: str) -> None:
        snippet = text[max(0, position - 10) : position + 10]
        super().__init__(f"invalid selector at position {position}: {reason} (near {snippet!r})")
        self.position = position
        self.reason = reason


@dataclass(frozen=True)
class Clause:
    """One condition: `values` has one entry except for `in` and `not in`.

    `key` is a standard attribute or `custom.NAME`. `attested` (written `@key`) restricts
    it to the device's attested attributes.
    """

    key: str
    op: str
    values: tuple[str, ...]
    attested: bool = False

    def __str__(self) -> str:
        key = ATTESTED_MARK + self.key if self.attested else self.key
        if self.op in LIST_OPERATORS:
            return f"{key} {self.op} ({', '.join(map(_quote, self.values))})"
        return f"{key}{self.op}{_quote(self.values[0])}"


def unknown_key(key: str) -> str:
    """Say why a bare key is refused, naming the standard key it most likely meant."""
    custom = f"for a custom attribute, write `{CUSTOM_PREFIX}{key[:64]}`"
    if key == CUSTOM_PREFIX[:-1]:
        return f"a custom attribute is written `{CUSTOM_PREFIX}NAME` (e.g. custom.tier=gold)"
    if key == "attested":
        return "match attested values with `@KEY` (e.g. @region=eu), not an `attested` key"
    folded = {k.lower(): k for k in STANDARD_KEYS}
    close = [folded[key.lower()]] if key.lower() in folded else []
    close = close or difflib.get_close_matches(key, STANDARD_KEYS, n=1, cutoff=0.6)
    if close:
        return f"unknown attribute {key!r:.70}: did you mean `{close[0]}`? ({custom})"
    return f"unknown attribute {key!r:.70}: use one of {', '.join(STANDARD_KEYS)}; {custom}"


def _quote(value: str) -> str:
    if value and _BARE_CHARS.issuperset(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass(frozen=True, eq=False, repr=False)
class Selector:
    """A parsed, type-checked selector; build it with `parse_selector`."""

    text: str
    clauses: tuple[Clause, ...]
    _canonical: str
    _tests: tuple[Test, ...]

    def matches(self, attrs: Mapping) -> bool:
        """Return whether canonical device attributes satisfy every clause."""
        for test in self._tests:
            if not test(attrs):
                return False
        return True

    def keys(self) -> frozenset[str]:
        """Return the attribute keys the clauses look at (`@tags` counts as `tags`).

        Custom ones as written, `custom.NAME`.
        """
        return frozenset(clause.key for clause in self.clauses)

    def __str__(self) -> str:
        return self._canonical

    def __repr__(self) -> str:
        return f"Selector({self._canonical!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Selector):
            return NotImplemented
        return self._canonical == other._canonical

    def __hash__(self) -> int:
        return hash(self._canonical)

    def __reduce__(self) -> tuple:
        # The compiled closures do not pickle; the text rebuilds them.
        return parse_selector, (self.text,)


def parse_selector(text: str, *, strict: bool = False) -> Selector:
    """Parse and type-check `text`; an empty selector matches the whole fleet.

    With `strict` (a selector an operator writes now), a bare key must be a standard
    attribute: custom ones are `custom.KEY`, and any other key is refused as a typo,
    naming the closest standard key. Without it (a selector stored earlier), a bare
    unknown key is read as a custom one, as selectors were once written.

    Raises SelectorError (an InvalidArgument) at the first problem in text order.
    """
    if len(text) > MAX_TEXT:
        raise SelectorError(text, MAX_TEXT, f"selector is longer than {MAX_TEXT} characters")
    compiled = _Parser(text, strict=strict).selector()
    clauses = tuple(clause for clause, _ in compiled)
    canonical = ", ".join(map(str, clauses))
    return Selector(text, clauses, canonical, tuple(test for _, test in compiled))


class _Parser:
    """Recursive descent with one cursor; each clause is compiled as soon as it parses."""

    def __init__(self, text: str, *, strict: bool = False) -> None:
        self.text = text
        self.pos = 0
        self.strict = strict

    def fail(self, reason: str, position: int | None = None) -> NoReturn:
        raise SelectorError(self.text, self.pos if position is None else position, reason)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip(self, chars: frozenset[str]) -> str:
        start = self.pos
        while self.peek() in chars:
            self.pos += 1
        return self.text[start : self.pos]

    def selector(self) -> list[tuple[Clause, Test]]:
        compiled: list[tuple[Clause, Test]] = []
        canonical_length = -2
        self.skip(_SPACE)
        while self.peek():
            if len(compiled) == MAX_CLAUSES:
                self.fail(f"more than {MAX_CLAUSES} clauses")
            start = self.pos
            compiled.append(self.clause())
            # str() adds spaces a dense text left out; it must still parse back.
            canonical_length += 2 + len(str(compiled[-1][0]))
            if canonical_length > MAX_TEXT:
                self.fail(f"selector is longer than {MAX_TEXT} characters once normalized", start)
            self.separator()
        return compiled

    def separator(self) -> None:
        self.skip(_SPACE)
        if not self.peek():
            return
        if self.peek() != ",":
            self.fail(f"expected ',' between clauses, found {self.peek()!r}")
        comma = self.pos
        self.pos += 1
        self.skip(_SPACE)
        if not self.peek():
            self.fail("trailing ','", comma)

    def clause(self) -> tuple[Clause, Test]:
        attested = self.attested_mark()
        key_pos = self.pos
        key = self.attribute(self.key(), key_pos)
        self.skip(_SPACE)
        op_pos = self.pos
        op = self.operator(key)
        if op in LIST_OPERATORS:
            values, positions = self.value_list(op)
        else:
            self.skip(_SPACE)
            positions = (self.pos,)
            values = (self.value(f"after {op!r}"),)
        clause = Clause(key, op, values, attested)
        return clause, _compile(clause, op_pos, positions, self.fail)

    def attested_mark(self) -> bool:
        if self.peek() != ATTESTED_MARK:
            return False
        self.pos += 1
        char = self.peek()
        # A key, or a mistake in one that `key` names better (a digit first, quotes).
        if char not in _KEY_CHARS and char != '"':
            found = f"found {char!r}" if char else "found the end"
            self.fail(f"expected a key right after '@' (as in @tags=beta), {found}")
        return True

    def key(self) -> str:
        char = self.peek()
        if char == ",":
            self.fail("empty clause (nothing before ',')")
        if char == '"':
            start = self.pos
            self.quoted()
            self.fail("keys are not quoted", start)
        if char not in _KEY_START:
            if char in _KEY_CHARS:
                self.fail(f"a key must start with a letter or '_', found {char!r}")
            self.fail(f"expected a key, found {char!r}")
        key = self.skip(_KEY_CHARS)
        char = self.peek()
        if char not in _SPACE and char not in _OP_CHARS and char not in ("", ","):
            self.fail(f"{char!r} is not allowed in a key (letters, digits, _ . -)")
        return key

    def attribute(self, key: str, start: int) -> str:
        """Return the key as a clause holds it: a standard attribute or `custom.NAME`."""
        if key in STANDARD_KEYS:
            return key
        if key.startswith(CUSTOM_PREFIX):
            if not _CUSTOM_NAME.fullmatch(key[len(CUSTOM_PREFIX) :]):
                self.fail(
                    "a custom attribute is custom.NAME, NAME a letter or '_' then letters, "
                    "digits, _ . - (at most 64)",
                    start,
                )
            return key
        if not self.strict:  # stored before custom keys were written custom.KEY
            return CUSTOM_PREFIX + key
        self.fail(unknown_key(key), start)

    def operator(self, key: str) -> str:
        start, char = self.pos, self.peek()
        if char in _OP_CHARS:
            return self.symbol_operator()
        word = self.skip(_KEY_CHARS)
        if word == "not":
            self.skip(_SPACE)
            after = self.pos
            if self.skip(_KEY_CHARS) != "in":
                self.fail("expected 'in' after 'not'", after)
            return "not in"
        if word == "in":
            return word
        if not word and char in ("", ","):
            self.fail(f"missing operator after key {key!r}")
        expected = ", ".join((*SYMBOL_OPERATORS, *LIST_OPERATORS))
        self.fail(f"expected an operator ({expected}), found {(word or char)!r}", start)

    def symbol_operator(self) -> str:
        start = self.pos
        run = self.skip(_OP_CHARS)
        if run in SYMBOL_OPERATORS:
            return run
        known = run[:2] if run[:2] in SYMBOL_OPERATORS else run[:1]
        if known in SYMBOL_OPERATORS and run[len(known)] == "=":
            hint = " (equality is a single '=')" if known == "=" else ""
            self.fail(f"unexpected '='{hint}", start + len(known))
        self.fail(f"unknown operator {run!r}", start)

    def value_list(self, op: str) -> tuple[tuple[str, ...], tuple[int, ...]]:
        self.skip(_SPACE)
        opened = self.pos
        if self.peek() != "(":
            self.fail(f"expected '(' after {op!r}")
        self.pos += 1
        values: list[str] = []
        positions: list[int] = []
        while True:
            self.skip(_SPACE)
            if len(values) == MAX_VALUES:
                self.fail(f"more than {MAX_VALUES} values in a list")
            positions.append(self.pos)
            values.append(self.value("in the list"))
            self.skip(_SPACE)
            char = self.peek()
            if not char:
                self.fail(f"missing ')' to close the list opened at position {opened}")
            if char not in ",)":
                self.fail(f"expected ',' or ')' in the list, found {char!r}")
            self.pos += 1
            if char == ")":
                return tuple(values), tuple(positions)

    def value(self, where: str) -> str:
        char = self.peek()
        if char == '"':
            return self.quoted()
        if char in _BARE_CHARS:
            value = self.skip(_BARE_CHARS)
            after = self.peek()
            if after not in _SPACE and after not in ("", ",", ")"):
                self.fail(f"{after!r} is not allowed in an unquoted value; double-quote the value")
            return value
        if char in ("", ",", ")"):
            self.fail(f"missing value {where}")
        self.fail(f"unexpected {char!r} where a value should be")

    def quoted(self) -> str:
        start = self.pos
        self.pos += 1
        out: list[str] = []
        while (char := self.peek()) != '"':
            if not char:
                self.fail(_UNTERMINATED, start)
            if _CONTROL.match(char):
                self.fail("control character in a quoted value")
            if char == "\\":
                char = self.escaped(start)
            out.append(char)
            self.pos += 1
        self.pos += 1
        return "".join(out)

    def escaped(self, start: int) -> str:
        self.pos += 1
        char = self.peek()
        if not char:
            self.fail(_UNTERMINATED, start)
        if char not in ('"', "\\"):
            escape = "\\" + char
            self.fail(f'unknown escape {escape!r} (only \\" and \\\\)', self.pos - 1)
        return char
