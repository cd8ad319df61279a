"""The canonical shape of device attributes and its rules, as both sides check them.

A device reports its attributes (`skiff agent run --attr KEY=VALUE`) and the control
plane stores and selects on them; both must accept and refuse the same sets, in the same
words, so the shape is defined here once (control_plane.fleet.attributes adds what only
the control plane does with it: the attested attributes an enrollment token stamps).

    {"platform": str, "os_version": str, "app_version": str, "device_model": str,
     "soc": str, "ram_mb": int, "region": str, "tags": [sorted unique str],
     "custom": {str: str}}

A key a device does not report is absent rather than empty, so "does not report it" has
one spelling. The reserved key `"attested"` is refused here: only the control plane adds
it, from the token's record.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from contract import errors
from contract.limits import MAX_ATTRIBUTE, check_text

STANDARD_KEYS = (
    "platform",
    "os_version",
    "app_version",
    "device_model",
    "soc",
    "ram_mb",
    "region",
    "tags",
)
CUSTOM = "custom"
# The reserved key of the effective attributes that holds the attested ones (see above).
ATTESTED = "attested"
MAX_TEXT = MAX_ATTRIBUTE
MAX_TAGS = 32
MAX_CUSTOM = 32
MAX_RAM_MB = 2**31

_ALLOWED_KEYS = frozenset((*STANDARD_KEYS, CUSTOM))
_TAG = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_CUSTOM_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_TAG_CONTAINERS = (list, tuple, set, frozenset)


def normalize_attributes(raw: Mapping[str, object]) -> dict:
    """Validate `raw` and return its canonical form (see the module docstring)."""
    if not isinstance(raw, Mapping):
        raise errors.InvalidArgument(f"attributes must be a mapping, not {type(raw).__name__}")
    if ATTESTED in raw:
        raise errors.InvalidArgument(
            f"attribute key {ATTESTED!r} is reserved: only an enrollment token attests attributes"
        )
    unknown = sorted(repr(key) for key in raw if key not in _ALLOWED_KEYS)
    if unknown:
        raise errors.InvalidArgument(
            f"unknown attribute key {', '.join(unknown)} (custom keys go under 'custom')"
        )
    out: dict = {}
    for key in STANDARD_KEYS:
        value = raw.get(key)
        if value is not None and value != "":
            out[key] = _normalize_standard(key, value)
    custom = _normalize_custom(raw.get(CUSTOM))
    if custom:
        out[CUSTOM] = custom
    return out


def parse_attr_flags(items: Sequence[str]) -> dict:
    """Parse CLI `KEY=VALUE` items into canonical attributes.

    Standard keys fill their slot, `tags=a` may repeat and accepts `tags=a,b` (`tags=`
    alone reports an empty tag list), and `custom.KEY=VALUE` (as selectors write it) sets
    custom key KEY; any other key becomes a custom key too, as it always has.
    """
    raw: dict = {}
    custom: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise errors.InvalidArgument(f"attribute {item!r} is not KEY=VALUE")
        if key.startswith(CUSTOM + ".") and len(key) > len(CUSTOM) + 1:
            key = key[len(CUSTOM) + 1 :]
            if key in custom:
                raise errors.InvalidArgument(f"attribute {key!r} is given more than once")
            custom[key] = value
            continue
        if key == "tags":
            raw.setdefault("tags", []).extend(value.split(",") if value else [])
            continue
        slot = raw if key in _ALLOWED_KEYS else custom
        if key in slot:
            raise errors.InvalidArgument(f"attribute {key!r} is given more than once")
        slot[key] = value
    if CUSTOM in raw:
        # Reach the custom-key check, whose message names the reserved key.
        custom[CUSTOM] = raw.pop(CUSTOM)
    return normalize_attributes({**raw, CUSTOM: custom})


def _normalize_standard(key: str, value: object) -> object:
    if key == "tags":
        return _normalize_tags(value)
    if key == "ram_mb":
        return _normalize_ram(value)
    return _check_text(f"attribute {key!r}", value)


def _check_text(what: str, value: object) -> str:
    return check_text(what, value, MAX_TEXT)


def _normalize_ram(value: object) -> int:
    rule = f"attribute 'ram_mb' must be an integer from 0 to {MAX_RAM_MB}"
    # bool is an int subclass, and True is not a memory size.
    if isinstance(value, str) and value.isascii() and value.isdecimal() and len(value) <= 16:
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_RAM_MB:
        raise errors.InvalidArgument(f"{rule}, got {value!r:.40}")
    return value


def _normalize_tags(value: object) -> list[str]:
    if not isinstance(value, _TAG_CONTAINERS):
        raise errors.InvalidArgument(
            f"attribute 'tags' must be a list of strings, not {type(value).__name__}"
        )
    for tag in value:
        if not isinstance(tag, str) or not _TAG.fullmatch(tag):
            raise errors.InvalidArgument(
                f"tag {tag!r:.80} must be 1 to 64 characters of A-Z a-z 0-9 _ . : -"
            )
    tags = sorted(set(value))
    if len(tags) > MAX_TAGS:
        raise errors.InvalidArgument(f"attribute 'tags' must have at most {MAX_TAGS} tags")
    return tags


def _normalize_custom(value: object) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise errors.InvalidArgument(
            f"attribute 'custom' must be a mapping, not {type(value).__name__}"
        )
    out = {}
    for key, item in value.items():
        _check_custom_key(key)
        if item is not None and item != "":
            out[key] = _check_text(f"custom attribute {key!r}", item)
    if len(out) > MAX_CUSTOM:
        raise errors.InvalidArgument(f"attribute 'custom' must have at most {MAX_CUSTOM} keys")
    return dict(sorted(out.items()))


def _check_custom_key(key: object) -> None:
    if not isinstance(key, str) or not _CUSTOM_KEY.fullmatch(key):
        raise errors.InvalidArgument(
            f"custom key {key!r:.80} must be a letter or '_' then up to 63 of A-Z a-z 0-9 _ . -"
        )
    if key in _ALLOWED_KEYS:
        raise errors.InvalidArgument(
            f"custom key {key!r} is reserved (it is a standard key or 'custom')"
        )
