"""Documents over the control plane's records and messages, for every surface at once.

The CLI's `--json`, the dashboard's pages and JSON API, and /metrics all show the same
devices, rollouts and models; each document is built here, once, so the surfaces cannot
drift apart and none of them imports another (the dashboard never goes through the CLI).
Text and tables for people stay with the CLI (`control_plane.cli`).
"""

from __future__ import annotations


def listed(key: str, items: list, *, more: bool = False) -> dict:
    """Return the one JSON shape of every list (`ls --json`, `model show`, `/api/v1`).

    An object: the items under their plural name (`devices`, `models`, `rollouts`,
    `tokens`, `versions`), in the listing's order, and `more`, true when --limit left
    some out. Scripts read `.devices[]`; a cut-short list says so in the document itself.
    """
    return {key: items, "more": more}
