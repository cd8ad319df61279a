"""Many rows through one statement, straight to the driver's executemany.

SQLAlchemy's executemany builds a parameter dict per row and runs every value through
its type's processor in Python (~15-20 us a row of the rollup tables): most of what a
roller's round spent outside its own arithmetic. `Bulk` compiles its statement once per
dialect, takes each column's bind processor from SQLAlchemy itself (the same conversion
`session.execute` would apply: a datetime's text on SQLite, JSON documents), and hands
the driver plain tuples (or dicts, for a driver with named parameters) in one call. It
runs on the session's own connection and transaction, and database errors come out as
SQLAlchemy's (`exec_driver_sql`), sorted by the store like any other.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, bindparam
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import Session


@dataclass(frozen=True)
class _Compiled:
    sql: str
    names: tuple[str, ...]  # bind names, in the order the driver takes them if positional
    positional: bool
    reorder: Callable[[Sequence[Any]], tuple]  # a row's values in the driver's order
    convert: tuple[tuple[int, Callable[[Any], Any]], ...]  # (slot, processor) needing one


class Bulk:
    """An INSERT or UPDATE of `columns` (values given per row, in that order)."""

    def __init__(self, statement, columns: Sequence[str]) -> None:
        self._statement, self._columns = statement, tuple(columns)
        self._compiled: dict[str, _Compiled] = {}
        self._lock = threading.Lock()

    @classmethod
    def insert(cls, table: Table, columns: Sequence[str]) -> Bulk:
        """INSERT rows of `columns` into `table` (nothing returned)."""
        statement = table.insert().inline().values({c: bindparam(c) for c in columns})
        return cls(statement, columns)

    @classmethod
    def update(cls, table: Table, columns: Sequence[str], key: Sequence[str]) -> Bulk:
        """UPDATE `columns` of the row whose `key` columns match.

        Values are columns, then key: the order of the statement's own parameters, so
        rows go to a positional driver as they are.
        """
        where = [table.c[k] == bindparam("k_" + k) for k in key]
        statement = table.update().where(*where).values({c: bindparam(c) for c in columns})
        return cls(statement, [*columns, *("k_" + k for k in key)])

    def run(self, session: Session, rows: Sequence[Sequence[Any]]) -> None:
        """Run the statement once per row (each a sequence of values in column order)."""
        if not rows:
            return
        connection = session.connection()
        compiled = self._for(connection.dialect)
        if compiled.convert:
            rows = [_converted(row, compiled.convert) for row in rows]
        if compiled.positional:
            params: list = list(map(compiled.reorder, rows))
        else:
            params = [dict(zip(self._columns, row, strict=True)) for row in rows]
        connection.exec_driver_sql(compiled.sql, params)

    def _for(self, dialect: Dialect) -> _Compiled:
        which = f"{dialect.name}+{dialect.driver}"  # drivers of one database differ in style
        found = self._compiled.get(which)
        if found is not None:
            return found
        with self._lock:
            compiled = self._statement.compile(dialect=dialect)
            names = tuple(compiled.positiontup or ()) if compiled.positional else ()
            if sorted(compiled.binds) != sorted(self._columns):
                # A column with a default is bound too: SQLAlchemy fills it in per row,
                # which the driver alone cannot. Every such column must be given.
                missing = sorted(set(compiled.binds) - set(self._columns))
                raise ValueError(f"{self._statement.table.name}: give values for {missing}")
            convert = []
            for slot, name in enumerate(self._columns):
                kind = compiled.binds[name].type.dialect_impl(dialect)
                processor = kind.bind_processor(dialect)
                if processor is not None:
                    convert.append((slot, processor))
            order = [self._columns.index(name) for name in names] or [0]
            reorder = operator.itemgetter(*order) if len(order) > 1 else _one(order[0])
            found = _Compiled(str(compiled), names, compiled.positional, reorder, tuple(convert))
            self._compiled[which] = found
        return found


def _converted(row: Sequence[Any], convert) -> list:
    out = list(row)
    for slot, processor in convert:
        out[slot] = processor(out[slot])
    return out


def _one(slot: int) -> Callable[[Sequence[Any]], tuple]:
    return lambda row: (row[slot],)
