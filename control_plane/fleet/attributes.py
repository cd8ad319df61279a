"""Device attributes: one canonical JSON shape for the DB, `skiff fleet ls --json` and selectors.

    {"platform": str, "os_version": str, "app_version": str, "device_model": str,
     "soc": str, "ram_mb": int, "region": str, "tags": [sorted unique str],
     "custom": {str: str}}

A key a device does not report is absent rather than empty, so "does not report it" has
one spelling; selectors rely on that (a clause on an absent key never matches). An empty
`tags` list is kept: it says the device reports tags and has none. Every function here
returns the canonical form and raises InvalidArgument naming the key and the rule.

**Attested attributes.** What an enrollment token stamps is attested: the device cannot
change it, add to it or take from it. A device's *effective* attributes (what
`effective_attributes` returns, what every Sync stores in `devices.attributes` and what
every selector is evaluated on: the resolver, delivery, Download, the telemetry roller,
`fleet ls --select`) are the canonical shape above plus, when the token stamped anything,
the reserved key `"attested"` holding the stamped attributes in that same canonical shape:

    {"region": "eu", "tags": ["internal"], "platform": "android",
     "attested": {"region": "eu", "tags": ["internal"]}}

Stamped values always win (key by key, custom keys one by one) and stamped tags are
exclusive: when the token stamps tags, the tags the device reports are ignored. A token
stamps tags only when it names at least one: an empty stamped list is no stamp (the wire
cannot tell "no tags" from "tags not given", so every token made over gRPC without tags
stored an empty list). So every attested value is also the effective value: a plain
clause (`tags=internal`) sees reported and stamped values alike, while an `@` clause
(`@tags=internal`) looks only under `"attested"`.

The key travels inside the one dict on purpose: every caller that evaluates a selector
gets it without passing anything new, and none can forget to. A device cannot forge it:
`normalize_attributes`, which every reported set goes through, refuses `"attested"`, and
only `effective_attributes` adds it, from the token's record. A device enrolled before
attestation existed gets its `"attested"` at its next Sync; until then `@` clauses do not
match it (they fail closed), and its stored tags may still hold what it claimed.
"""

from __future__ import annotations

from collections.abc import Mapping

# The canonical shape and its rules are what a device checks too: they live in the contract.
from contract.attribute_rules import (
    ATTESTED,
    CUSTOM,
    STANDARD_KEYS,
    normalize_attributes,
    parse_attr_flags,
)

__all__ = [
    "ATTESTED",
    "CUSTOM",
    "STANDARD_KEYS",
    "attested_attributes",
    "effective_attributes",
    "normalize_attributes",
    "parse_attr_flags",
]


def effective_attributes(reported: Mapping, stamped: Mapping) -> dict:
    """Return a device's effective attributes: `reported` under `stamped`, with `"attested"`.

    Stamped keys win key by key and custom keys one by one; stamped tags (at least one)
    replace the reported ones, so a device cannot add a tag to a set its token fixed.
    What the token stamps is also kept under `"attested"` (absent when it stamps
    nothing), which `@` selector clauses read. See the module docstring.
    """
    mine = normalize_attributes(reported)
    theirs = normalize_attributes(stamped) if stamped else {}
    if theirs.get("tags") == []:
        # No stamp: the wire cannot tell "no tags" from "tags not given", so every token
        # made over gRPC without tags stored an empty list (see the module docstring).
        del theirs["tags"]
    if not theirs:  # nothing stamped (most devices): what it reports, already canonical
        return mine
    merged = normalize_attributes(
        {**mine, **theirs, CUSTOM: {**mine.get(CUSTOM, {}), **theirs.get(CUSTOM, {})}}
    )
    if theirs:
        merged[ATTESTED] = theirs
    return merged


def attested_attributes(effective: Mapping) -> dict:
    """Return the attested part of effective attributes ({} when nothing is attested)."""
    return dict(effective.get(ATTESTED, {}))
