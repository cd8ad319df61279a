"""`skiff init`: the embedded default in one folder (SQLite, blob dir, keys, admin token)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from control_plane import errors
from control_plane.api.auth import ADMIN, hash_token, new_token
from control_plane.api.transport import init_tls
from control_plane.blobs.local_blob_store import LocalBlobStore
from control_plane.crypto import LocalKek, ManifestSigner
from control_plane.files import write_private_file
from control_plane.pins import write_pins
from control_plane.settings import CONFIG_FILE, TOKEN_FILE, Config, write_config_file
from control_plane.store.sql_store import SqlStore
from device_agent.signing_keys import KeyRing


@dataclass(frozen=True)
class InitResult:
    """What `init` made (paths only: the token itself stays in its 0600 file)."""

    home: Path
    config_file: Path
    token_file: Path
    kek: str
    signing_key: str
    db: str
    blobs: str
    tls_cert: str
    tls_ca: str


def init_home(config: Config, *, tls_names: Iterable[str] = ()) -> InitResult:
    """Create keys, TLS certificates, schema, admin token and config file.

    Refuses an initialised home. `tls_names` are extra host names (or addresses) for the
    generated server certificate, for clients that dial this machine over a network.
    """
    home = config.home
    if (home / CONFIG_FILE).exists():
        raise errors.AlreadyExists(f"{home} is already initialised (remove it to start over)")
    (home / "keys").mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(home, 0o700)
    config = init_tls(config, tls_names)
    if not config.blobs.startswith("s3://"):
        # The local store never creates its root (a missing root may be an unmounted
        # volume); creating the home is the one time it should exist from nothing.
        LocalBlobStore.from_url(config.blobs).root.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not config.kek.startswith("aws-kms://"):
        LocalKek.create(config.kek)
    signer = ManifestSigner.create(config.signing_key)
    write_pins(home, KeyRing.from_pems([signer.public_key_pem()]))  # what `model pull` trusts
    store = SqlStore(config.db)
    try:
        token = new_token()
        store.add_token(
            name=ADMIN, role=ADMIN, token_sha256=hash_token(token), created_by="skiff init"
        )
    finally:
        store.close()
    token_file = home / TOKEN_FILE
    write_private_file(token_file, (token + "\n").encode(), replace=False)
    config_file = write_config_file(config)
    return InitResult(
        home=home,
        config_file=config_file,
        token_file=token_file,
        kek=config.kek,
        signing_key=config.signing_key,
        db=config.db,
        blobs=config.blobs,
        tls_cert=config.tls_cert,
        tls_ca=config.tls_ca,
    )


def read_token(home: Path) -> str:
    """Return the admin token: $SKIFF_TOKEN wins, else the home folder's token file."""
    token = os.environ.get("SKIFF_TOKEN", "").strip()
    if token:
        return token
    path = home / TOKEN_FILE
    try:
        return path.read_text().strip()
    except FileNotFoundError:
        raise errors.Unauthenticated(
            f"no admin token: run `skiff init` or set SKIFF_TOKEN ({path} missing)"
        ) from None
