"""Every control-plane setting, declared once: name, type, default, doc.

Values come from (highest first) a command-line flag, an environment variable, the home
folder's `skiff.json` (written by `skiff init`), then the default. They are read once at
the entry point and passed in; nothing below the CLI reads the environment.

`skiff.json` keeps only what came from a flag or from the file itself (and what the
server changed, like a KEK rotation): a value from the environment may be a secret (a
password in `SKIFF_DB`) that its owner keeps out of files, and stays where it came from.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from contract import errors
from contract.key_files import write_private_file

CONFIG_FILE = "skiff.json"
TOKEN_FILE = "admin.token"
# Where a setting's value came from.
FROM_FLAG, FROM_ENV, FROM_FILE, FROM_DEFAULT = "flag", "env", "file", "default"
_PERSISTED = frozenset({FROM_FLAG, FROM_FILE})


def default_home() -> Path:
    """Return the home folder: $SKIFF_HOME, else ~/.skiff."""
    return Path(os.environ.get("SKIFF_HOME") or Path.home() / ".skiff")


def url_list(raw: str | Sequence[str]) -> tuple[str, ...]:
    """Parse a list of URLs: a JSON list from skiff.json, or comma-separated text."""
    items = raw.split(",") if isinstance(raw, str) else raw
    return tuple(item.strip() for item in items if item.strip())


@dataclass(frozen=True)
class Setting:
    """One declared setting."""

    name: str
    type: Callable[[Any], Any]
    default: Any
    env: str
    doc: str


SETTINGS: tuple[Setting, ...] = (
    Setting("grpc", str, "127.0.0.1:7443", "SKIFF_GRPC", "gRPC listen address (HOST:PORT)."),
    Setting("server", str, "", "SKIFF_SERVER", "Address the CLI dials; defaults to `grpc`."),
    Setting(
        "http",
        str,
        "",
        "SKIFF_HTTP",
        "Dashboard and /metrics listen address (HOST:PORT); empty: no dashboard.",
    ),
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
        "db_pool_size",
        int,
        0,
        "SKIFF_DB_POOL_SIZE",
        "Database connections a server process keeps; 0: 24, or with --workers an even "
        "share of 3/4 of PostgreSQL's max_connections.",
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
        "mnn_memory_limit_bytes",
        int,
        8 << 30,
        "SKIFF_MNN_MEMORY_LIMIT_BYTES",
        "Address space one MNN child may use (RLIMIT_AS); keep it above 3x max_model_bytes.",
    ),
    Setting(
        "mnn_cpu_limit_s",
        float,
        0.0,
        "SKIFF_MNN_CPU_LIMIT_S",
        "CPU seconds one MNN child may use, all threads (RLIMIT_CPU); 0: 2x mnn_timeout_s.",
    ),
    Setting(
        "mnn_user",
        str,
        "nobody",
        "SKIFF_MNN_USER",
        "User MNN children switch to when the server runs as root (cannot read the keys).",
    ),
    Setting(
        "max_concurrent_uploads",
        int,
        4,
        "SKIFF_MAX_CONCURRENT_UPLOADS",
        "Uploads received or waiting at once (each up to max_model_bytes of RAM); more fail.",
    ),
    Setting(
        "upload_idle_timeout_s",
        float,
        60.0,
        "SKIFF_UPLOAD_IDLE_TIMEOUT_S",
        "An upload that sends nothing for this long is cut off.",
    ),
    Setting(
        "max_concurrent_rpcs",
        int,
        50_000,
        "SKIFF_MAX_CONCURRENT_RPCS",
        "Calls the server carries at once, device Watch streams included (0: no limit).",
    ),
    Setting(
        "kek_keyring",
        url_list,
        (),
        "SKIFF_KEK_KEYRING",
        "Other KEKs data keys may be wrapped under (comma-separated); kept by key rotation.",
    ),
    Setting("tls_cert", str, "", "SKIFF_TLS_CERT", "Server TLS certificate (PEM); init makes one."),
    Setting("tls_key", str, "", "SKIFF_TLS_KEY", "Private key of tls_cert (PEM, mode 0600)."),
    Setting(
        "tls_ca",
        str,
        "",
        "SKIFF_CA",
        "CA certificate clients verify the server against (empty: the system's roots).",
    ),
    Setting(
        "tls_client_ca",
        str,
        "",
        "SKIFF_TLS_CLIENT_CA",
        "When set, the server requires client certificates signed by this CA (mutual TLS).",
    ),
    Setting(
        "tls_client_cert",
        str,
        "",
        "SKIFF_TLS_CLIENT_CERT",
        "Certificate the CLI presents to a server that requires one (mutual TLS).",
    ),
    Setting("tls_client_key", str, "", "SKIFF_TLS_CLIENT_KEY", "Private key of tls_client_cert."),
    Setting(
        "chunk_min_bytes",
        int,
        1 << 20,
        "SKIFF_CHUNK_MIN_BYTES",
        "Variants of at least this many bytes are also stored as content-defined chunks, so "
        "a device fetches only the chunks a new version changed (0: never; every variant is "
        "then one artifact, fetched through presigned URLs where the blob store gives them).",
    ),
    Setting(
        "gc_grace_s",
        float,
        0.0,
        "SKIFF_GC_GRACE_S",
        "Age before an unreferenced blob is collected; more than twice the longest push "
        "(0: derived from mnn_timeout_s and max_model_bytes).",
    ),
    Setting(
        "gc_interval_s",
        float,
        3600.0,
        "SKIFF_GC_INTERVAL_S",
        "How often the server sweeps unreferenced blobs (0: never; `skiff gc` still works).",
    ),
    Setting(
        "health_interval_s",
        float,
        5.0,
        "SKIFF_HEALTH_INTERVAL_S",
        "How often the health service probes the database and the blob store.",
    ),
    Setting(
        "device_class",
        str,
        "soc,device_model,os_version:major",
        "SKIFF_DEVICE_CLASS",
        "Attributes telemetry is grouped by and rollouts are sliced by (`:major`: a "
        "version's first number).",
    ),
    Setting(
        "rollup_interval_s",
        float,
        5.0,
        "SKIFF_ROLLUP_INTERVAL_S",
        "How often reported telemetry is rolled up (and guardrails see it).",
    ),
    Setting(
        "rollup_minute_retention_h",
        float,
        48.0,
        "SKIFF_ROLLUP_MINUTE_RETENTION_H",
        "Hours 1-minute rollups are kept.",
    ),
    Setting(
        "rollup_hour_retention_d",
        float,
        90.0,
        "SKIFF_ROLLUP_HOUR_RETENTION_D",
        "Days 1-hour rollups are kept.",
    ),
    Setting(
        "rollup_day_retention_d",
        float,
        400.0,
        "SKIFF_ROLLUP_DAY_RETENTION_D",
        "Days 1-day rollups are kept.",
    ),
    Setting(
        "telemetry_raw_retention_h",
        float,
        48.0,
        "SKIFF_TELEMETRY_RAW_RETENTION_H",
        "Hours raw report batches are kept once rolled up (`fleet show` reads 24 hours).",
    ),
    Setting(
        "guard_interval_s",
        float,
        10.0,
        "SKIFF_GUARD_INTERVAL_S",
        "How often guardrails check running rollouts.",
    ),
    Setting(
        "guard_outliers",
        int,
        1,
        "SKIFF_GUARD_OUTLIERS",
        "How many devices no guardrail verdict or backend recommendation may hinge on: "
        "that many are left out each way, and a failing verdict needs one more showing it.",
    ),
    Setting(
        "recommend_min_devices",
        int,
        3,
        "SKIFF_RECOMMEND_MIN_DEVICES",
        "Distinct devices a backend config needs on a device class before it is recommended.",
    ),
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
    # Setting name -> (where its value came from, the value as loaded). Keyword-only, so
    # it needs no place among the settings below.
    origins: Mapping[str, tuple[str, Any]] = field(
        default_factory=dict, kw_only=True, compare=False, repr=False
    )
    grpc: str
    server: str
    http: str
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
    db_pool_size: int
    kms_endpoint: str
    kms_region: str
    mnn_memory_limit_bytes: int
    mnn_cpu_limit_s: float
    mnn_user: str
    max_concurrent_uploads: int
    upload_idle_timeout_s: float
    max_concurrent_rpcs: int
    kek_keyring: tuple[str, ...]
    tls_cert: str
    tls_key: str
    tls_ca: str
    tls_client_ca: str
    tls_client_cert: str
    tls_client_key: str
    chunk_min_bytes: int
    gc_grace_s: float
    gc_interval_s: float
    health_interval_s: float
    signing_overlap_s: int
    device_class: str
    rollup_interval_s: float
    rollup_minute_retention_h: float
    rollup_hour_retention_d: float
    rollup_day_retention_d: float
    telemetry_raw_retention_h: float
    guard_interval_s: float
    guard_outliers: int
    recommend_min_devices: int

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
    origins: dict[str, tuple[str, Any]] = {}
    for s in SETTINGS:
        origin, raw = _raw_value(s, overrides or {}, environ, stored, home)
        try:
            values[s.name] = s.default if raw in (None, "") else s.type(raw)
        except ValueError as exc:
            raise errors.InvalidArgument(f"setting {s.name}: {exc}") from None
        origins[s.name] = (origin, values[s.name])
    return Config(home=home, origins=origins, **values)


def _raw_value(
    s: Setting, overrides: Mapping[str, Any], environ: Mapping[str, str], stored: dict, home: Path
) -> tuple[str, Any]:
    """Return where `s` comes from and its raw value: flag, environment, file, default."""
    for origin, value in (
        (FROM_FLAG, overrides.get(s.name)),
        (FROM_ENV, environ.get(s.env)),
        (FROM_FILE, stored.get(s.name)),
    ):
        if value not in (None, ""):
            return origin, value
    return FROM_DEFAULT, _defaults_for(home).get(s.name)


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
    """Store `config`'s flag- and file-sourced settings (and changed ones) in its home.

    A setting whose value differs from what was loaded was changed by the process (a KEK
    rotation) and is kept; one from the environment or a default is not. The file is
    written 0600 through a fresh temp file (never a fixed name someone could plant).
    """
    path = config.home / CONFIG_FILE
    body = {}
    for s in SETTINGS:
        value = getattr(config, s.name)
        origin, loaded = config.origins.get(s.name, (FROM_FLAG, value))
        if value and (origin in _PERSISTED or value != loaded):
            body[s.name] = value
    data = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
    write_private_file(path, data, replace=True)
    return path
