"""How database errors leave the SQL store: sorted once into domain errors."""

from __future__ import annotations

import logging

from sqlalchemy import exc as sa_exc

from contract import errors

log = logging.getLogger("control_plane.store.sql_store")


def sorted_db_error(exc: sa_exc.SQLAlchemyError) -> errors.SkiffError:
    """Sort a database error once: lost connection is retryable, integrity is a conflict."""
    if isinstance(exc, sa_exc.IntegrityError):
        return errors.AlreadyExists("already exists (constraint violated)")
    if isinstance(exc, sa_exc.DataError):
        # A value the database refuses (NUL in text, too long, out of range) got past
        # validation: the caller's fault, but worth a line so the gap gets closed.
        log.warning("database refused a value: %s", type(exc.orig or exc).__name__)
        return errors.InvalidArgument("a value was refused by the database (malformed or too long)")
    if isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError | sa_exc.TimeoutError):
        return errors.Unavailable("database unavailable: " + type(exc.orig or exc).__name__)
    log.error("unexpected database error: %s", exc)
    return errors.SkiffError("database error: " + type(exc).__name__)
