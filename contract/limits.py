"""How long free text from outside may be, and what it may contain: one definition.

Every free-text field a caller can make the server store (model notes, rollout and
revoke reasons, token names, device attribute values) is checked here before it reaches
a database. The limits keep every stored row, and so every response that carries rows,
far below the 8 MiB gRPC message limit; the character rule keeps NUL out of PostgreSQL
(which refuses it in text columns) and escape sequences out of terminals and logs.
"""

from __future__ import annotations

import re

from contract import errors

# What a model name, a variant name and a version number may be anywhere they arrive
# from outside (pushes, rollouts, device reports); a model name also names files on
# devices. Versions are int32 columns.
MODEL_NAME = re.compile(r"[a-z0-9_-]{1,64}")
VARIANT_NAME = re.compile(r"[a-z0-9]{1,16}")
MAX_VERSION = 2**31 - 1

# Characters, not bytes: UTF-8 takes at most 4 bytes a character, so 4096 characters of
# notes are at most 16 KiB, and a full page of versions stays well under 8 MiB.
MAX_NOTES = 4096
# Rollout reasons (audit log) and device revoke reasons: one line for a person to read.
MAX_REASON = 256
# Labels: enrollment-token and API-token names.
MAX_NAME = 64
# Device attribute values (platform, os_version, ..., custom values).
MAX_ATTRIBUTE = 128

# C0, DEL and C1: they would corrupt one-line logs and terminal tables, and PostgreSQL
# refuses NUL in text. Multi-line text (notes) may also hold newlines and tabs.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_MULTILINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def strip_control(text: str, replacement: str = "?") -> str:
    """Return `text` with every control character but newline and tab replaced."""
    return _CONTROL_MULTILINE.sub(replacement, text)


def check_text(field: str, value: object, limit: int, *, multiline: bool = False) -> str:
    """Return `value` if it is a string of at most `limit` characters without control ones.

    Raises InvalidArgument naming `field` and the rule it broke. `multiline` allows
    newline and tab (for notes); every other control character is refused everywhere.
    """
    if not isinstance(value, str):
        raise errors.InvalidArgument(f"{field} must be a string, not {type(value).__name__}")
    if len(value) > limit:
        raise errors.InvalidArgument(f"{field} must be at most {limit} characters")
    if (_CONTROL_MULTILINE if multiline else _CONTROL).search(value):
        allowed = " (newline and tab are allowed)" if multiline else ""
        raise errors.InvalidArgument(f"{field} must not contain control characters{allowed}")
    return value
