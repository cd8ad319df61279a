"""Unique id prefixes: what `skiff fleet show dev_3f` and `skiff rollout show ro_9a` accept.

One rule for every kind of id: an exact id is itself; otherwise the one id that starts
with what was given. None is NotFound; several is InvalidArgument naming them, so a
prefix that stopped being unique (a device enrolled since) is refused, never guessed.
"""

from __future__ import annotations

from collections.abc import Sequence

from contract import errors

# How many of the ids an ambiguous prefix matches the error names.
SHOWN = 4


def only_match(kind: str, prefix: str, ids: Sequence[str], *, more: bool = False) -> str:
    """Return the one id in `ids` that starts with `prefix` (`ids` are candidates).

    `more` says `ids` was cut short (there are other matches besides); `kind` names the
    thing in the error ("device", "rollout").
    """
    if not prefix:
        raise errors.InvalidArgument(f"give a {kind} id")
    matches = [i for i in ids if i.startswith(prefix)]
    if len(matches) == 1 and not more:
        return matches[0]
    if not matches:
        raise errors.NotFound(f"no {kind} id starts with {prefix!r}")
    named = ", ".join(matches[:SHOWN])
    if more or len(matches) > SHOWN:
        named += ", ..."
    raise errors.InvalidArgument(
        f"{prefix!r} is the start of more than one {kind} id ({named}): give more of it"
    )
