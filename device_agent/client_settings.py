"""The TLS an agent dials its control plane with, from its flag, the environment or skiff.json.

`skiff agent run` reads the same three client settings the operator's commands read, in
the same order (the `--ca` flag, then SKIFF_CA / SKIFF_TLS_CLIENT_CERT /
SKIFF_TLS_CLIENT_KEY, then the home folder's `skiff.json`), and refuses a bad file in
the same words, so a device configured for either keeps working. A device-only install
has no control_plane.settings, so the few lines that resolve these three live here.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from contract import errors
from contract.key_files import client_tls_files
from contract.transport import ClientTls

# Setting name -> its environment variable (control_plane.settings declares the same).
_ENV = {
    "tls_ca": "SKIFF_CA",
    "tls_client_cert": "SKIFF_TLS_CLIENT_CERT",
    "tls_client_key": "SKIFF_TLS_CLIENT_KEY",
}


def client_tls(*, ca_flag: str | None, environ=None, home: Path | None = None) -> ClientTls:
    """Return what the agent trusts (the CA) and presents (a client pair) to its server."""
    environ = os.environ if environ is None else environ
    home = Path(home or environ.get("SKIFF_HOME") or Path.home() / ".skiff")
    stored = _config_file(home.expanduser().resolve())
    value = {
        name: str(
            (ca_flag if name == "tls_ca" else None) or environ.get(env) or stored.get(name) or ""
        )
        for name, env in _ENV.items()
    }
    return client_tls_files(value["tls_ca"], value["tls_client_cert"], value["tls_client_key"])


def _config_file(home: Path) -> dict:
    path = home / "skiff.json"
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise errors.InvalidArgument(f"cannot read {path}: {exc}") from None
    return {k: v for k, v in data.items() if k in _ENV}
