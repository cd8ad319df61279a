"""Every control-plane setting, declared once: name, type, default, doc.

Values come from (highest first) a command-line flag, an environment variable, the home
folder's `skiff.json` (written by `skiff init`), then the default. They are read once at
the entry point and passed in; nothing below the CLI reads the environment.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from control_plane import errors

CONFIG_FILE = "skiff.json"
TOKEN_FILE = "admin.token"


def default_home() -> Path:
    """Return the home folder: $SKIFF_HOME, else ~/.skiff."""
    return Path(os.environ.get("SKIFF_HOME") or Path.home() / ".skiff")


@dataclass(frozen=True)
class Setting:
    """One declared setting."""

    name: str
    type: type
    default: Any
    env: str
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting("grpc", str, "127.0.0.1:7443", "SKIFF_GRPC", "gRPC listen address (HOST:PORT)."),
    Setting("server", str, "", "SKIFF_SERVER", "Address the CLI dials; defaults to `grpc`."),
    Setting("db", str, "", "SKIFF_DB", "SQLAlchemy URL; default: SQLite in the home folder."),
    Setting("blobs", str, "", "SKIFF_BLOBS", "Blob store URL (file:// or s3://); default: home."),
    Setting("kek", str, "", "SKIFF_KEK", "Key-encryption key: file path or aws-kms:// URL."),
    Setting("signing_key", str, "", "SKIFF_SIGNING_KEY", "Ed25519 manifest signing key (PEM)."),
    Setting("max_model_bytes", int, 2 << 30, "SKIFF_MAX_MODEL_BYTES", "Largest accepted upload."),
    Setting("mnn_timeout_s", float, 600.0, "SKIFF_MNN_TIMEOUT_S", "Limit for one MNN job."),
    Setting(
        "max_concurrent_pushes",
        int,
        2,
        "SKIFF_MAX_CONCURRENT_PUSHES",
        "Pushes processed at once; more wait (each holds its model in RAM and runs MNN).",
    ),
    Setting(
        "poll_interval_s",
        int,
        300,
        "SKIFF_POLL_INTERVAL_S",
        "How often devices Sync when their Watch stream is down (they add jitter).",
    ),
    Setting(
        "assignment_ttl_s",
        int,
        86_400,
        "SKIFF_ASSIGNMENT_TTL_S",
        "Lifetime of a signed assignment; devices refuse an expired one.",
    ),
    Setting(
        "presign_ttl_s",
        int,
        900,
        "SKIFF_PRESIGN_TTL_S",
        "Lifetime of presigned artifact URLs (S3 blob stores).",
    ),
    Setting(
        "enroll_ttl_s",
        int,
        7 * 86_400,
        "SKIFF_ENROLL_TTL_S",
        "Default lifetime of an enrollment token.",
    ),
    Setting(
        "scheduler_interval_s",
        float,
        1.0,
        "SKIFF_SCHEDULER_INTERVAL_S",
        "How often rollouts whose stage has baked are advanced.",
    ),
    Setting(
        "device_flush_s",
        float,
        0.5,
        "SKIFF_DEVICE_FLUSH_S",
        "How often device reports (last_seen, installed) are written, in one batch.",
    ),
    Setting(
        "kms_endpoint",
        str,
        "",
        "SKIFF_KMS_ENDPOINT",
        "The only KMS endpoint aws-kms:// keys are used through (empty: AWS's own).",
    ),
    Setting("kms_region", str, "", "SKIFF_KMS_REGION", "AWS region of aws-kms:// keys."),
    Setting(
        "signing_overlap_s",
        int,
        7 * 86_400,
        "SKIFF_SIGNING_OVERLAP_S",
        "After a signing-key rotation, how long verifiers still accept the previous key.",
    ),
)


@dataclass(frozen=True)
class Config:
    """Resolved settings for one process."""

    home: Path
    grpc: str
    server: str
    db: str
    blobs: str
    kek: str
    signing_key: str
    max_model_bytes: int
    mnn_timeout_s: float
    max_concurrent_pushes: int
    poll_interval_s: int
    assignment_ttl_s: int
    presign_ttl_s: int
    enroll_ttl_s: int
    scheduler_interval_s: float
    device_flush_s: float
    kms_endpoint: str
    kms_region: str
    signing_overlap_s: int

    @property
    def dial_address(self) -> str:
        """Where a client connects."""
        return self.server or self.grpc


def _defaults_for(home: Path) -> dict[str, Any]:
    return {
        "db": f"sqlite:///{home / 'skiff.db'}",
        "blobs": (home / "blobs").as_uri(),
        "kek": str(home / "keys" / "kek.json"),
        "signing_key": str(home / "keys" / "signing_ed25519.pem"),
    }


def load_config(
    home: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Resolve every setting for `home` from flags, environment, config file and defaults."""
    home = Path(home or default_home()).expanduser().resolve()
    environ = os.environ if environ is None else environ
    stored = read_config_file(home)
    values: dict[str, Any] = {}
    for s in SETTINGS:
        raw = (overrides or {}).get(s.name)
        if raw in (None, ""):
            raw = environ.get(s.env) or stored.get(s.name) or _defaults_for(home).get(s.name)
        try:
            values[s.name] = s.default if raw in (None, "") else s.type(raw)
        except ValueError as exc:
            raise errors.InvalidArgument(f"setting {s.name}: {exc}") from None
    return Config(home=home, **values)


def read_config_file(home: Path) -> dict[str, Any]:
    """Return the settings stored in the home folder (empty when there is none)."""
    path = home / CONFIG_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise errors.InvalidArgument(f"cannot read {path}: {exc}") from None
    known = {f.name for f in fields(Config)}
    return {k: v for k, v in data.items() if k in known}


def write_config_file(config: Config) -> Path:
    """Store the non-default settings of `config` in its home folder."""
    path = config.home / CONFIG_FILE
    body = {s.name: getattr(config, s.name) for s in SETTINGS if getattr(config, s.name)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
    return path
