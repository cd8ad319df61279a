"""How every CLI command reaches its control plane: address, token and TLS from the home."""

from __future__ import annotations

from contract import errors
from control_plane.settings import Config


def admin_client(config: Config):
    """Return an AdminClient for `config`'s server, verified against its CA when it has one."""
    from contract.transport import address_problem
    from control_plane.api.client import AdminClient  # deferred: keeps `skiff --help` instant
    from control_plane.api.transport import client_tls
    from control_plane.home import read_token

    if problem := address_problem(config.dial_address):
        raise errors.InvalidArgument(f"SKIFF_SERVER (or `server` in skiff.json): {problem}")
    return AdminClient(config.dial_address, read_token(config.home), client_tls(config))
