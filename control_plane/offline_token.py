"""`skiff token create --offline`: an API token written into the database itself.

For when no server can be asked (its database has no admin token yet, or the token is
lost): whoever can write the database is admin already. The command line reaches a
running server through the API client; here, with no server, it reaches the database
through this one function, never through the store's classes.
"""

from __future__ import annotations

from pathlib import Path

from contract import errors
from control_plane.api.auth import ApiTokens, MadeToken
from control_plane.serve import db_description
from control_plane.store.sql_store import SqlStore


def create_offline_token(
    db_url: str, *, role: str, name: str, ttl_s: int, actor: str
) -> tuple[MadeToken, str]:
    """Make a token in the database at `db_url`; return it and the database's description.

    The database must already hold Skiff's schema: a mistyped URL must not create a new,
    empty database whose admin token the real server never sees. The description names
    the database without its password, for the caller's message.
    """
    where = db_description(db_url)
    sqlite_file = db_url.partition(":///")[2] if db_url.startswith("sqlite") else ""
    if sqlite_file and not Path(sqlite_file).is_file():
        raise errors.NotFound(f"no database at {where} (run `skiff init` or check --db)")
    store = SqlStore(db_url, migrate=False)
    try:
        if not store.has_schema():
            raise errors.NotFound(f"{where} holds no Skiff schema (start a server on it first)")
        return ApiTokens(store).create(role=role, name=name, ttl_s=ttl_s, actor=actor), where
    finally:
        store.close()
