"""How the CLI prints what a command returns: tables for people, whole values for pipes.

On a terminal, tables are drawn by rich and may be shortened to fit, except their ID
columns: an id is what the next command takes, so it is never wrapped or cut. Anywhere
else (a pipe, a file), tables are plain text, one row a line, nothing cut, so `grep`,
`awk` and `cut` see every value whole.
"""

from __future__ import annotations

import sys
from typing import TextIO

# Columns whose values are ids (what `fleet show`, `rollout ...`, `token revoke` take).
ID_HEADERS = frozenset({"ID"})


def print_output(renderable: object, file: TextIO | None = None) -> None:
    """Print a command's text output: rich on a terminal, plain text elsewhere."""
    out = file or sys.stdout
    if isinstance(renderable, str):
        print(renderable, file=out)
        return
    if not out.isatty():
        print(plain_text(renderable), file=out)
        return
    from rich.console import Console  # tables only: not loaded by the agent daemon

    keep_ids_whole(renderable)
    Console(file=out, highlight=False).print(renderable)


def keep_ids_whole(renderable: object) -> None:
    """Let rich shorten any column of a table (or of a group's tables) but the ids."""
    from rich.console import Group
    from rich.table import Table

    if isinstance(renderable, Group):
        for part in renderable.renderables:
            keep_ids_whole(part)
    if not isinstance(renderable, Table):
        return
    for column in renderable.columns:
        if str(column.header) in ID_HEADERS:
            column.no_wrap = True
            column.min_width = max((len(str(c)) for c in column.cells), default=0)


def plain_text(renderable: object) -> str:
    """Return a rich table, text or group of them as plain text, nothing cut or wrapped."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    if isinstance(renderable, str):
        return renderable
    if isinstance(renderable, Text):
        return renderable.plain
    if isinstance(renderable, Group):
        return "\n".join(plain_text(part) for part in renderable.renderables)
    if isinstance(renderable, Table):
        return _plain_table(renderable)
    raise TypeError(f"cannot print {type(renderable).__name__} as text")


def _plain_table(table) -> str:
    columns = [[_cell(c.header), *(_cell(v) for v in c.cells)] for c in table.columns]
    if not columns:
        return ""
    widths = [max(len(v) for v in column) for column in columns]
    rows = zip(*columns, strict=True)
    return "\n".join(
        "  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def _cell(value: object) -> str:
    from rich.text import Text

    # A cell holds one line; a value with a line break (a long selector?) stays one row.
    text = value.plain if isinstance(value, Text) else str(value)
    return " ".join(text.split("\n"))
