"""Key-encryption keys (KEKs): wrap and unwrap per-version data keys.

Two backends, chosen by URL in `open_kek`: a local Tink AEAD keyset file (the default)
and AWS KMS through boto3. Both bind a caller-chosen *context* (e.g. the model version
the data key belongs to) to the wrapped key, so a wrapped key copied onto another
version does not unwrap.

kek_id scheme: ``local:<primary key id>`` for a local keyset, where the id is the
decimal Tink key id exactly as it appears in the keyset file's ``primaryKeyId`` (so an
operator can grep for it), and ``aws-kms:<key id or ARN as configured>`` for KMS.
Rotation changes a local kek_id; KMS rotates key material behind a stable id itself.
"""

from __future__ import annotations

import abc
import io
import logging
import os
from collections.abc import Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import boto3
import botocore.config
import botocore.exceptions
import tink
from tink import aead, cleartext_keyset_handle
from tink.proto import tink_pb2

from control_plane import errors
from control_plane.files import read_private_file, write_private_file

aead.register()

_LOCAL_PREFIX = "local:"
_KMS_PREFIX = "aws-kms:"
_AD_PREFIX = b"skiff/kek/v1\x00"  # keeps these ciphertexts apart from any other use
_UNWRAP_FAILED = "wrapped data key failed authentication (wrong KEK or context)"

# Short timeouts and few retries: a publish waits on this call, and an unreachable KMS
# should surface as Unavailable within seconds, not after botocore's 60 s defaults.
_KMS_CONFIG = botocore.config.Config(
    connect_timeout=2, read_timeout=5, retries={"max_attempts": 2, "mode": "standard"}
)
# KMS error codes sorted once into domain errors; anything else propagates unchanged.
_KMS_ERRORS: Mapping[str, type[errors.SkiffError]] = {
    "InvalidCiphertextException": errors.IntegrityError,
    "IncorrectKeyException": errors.IntegrityError,
    "NotFoundException": errors.NotFound,
    "AccessDeniedException": errors.Unauthenticated,
    "UnrecognizedClientException": errors.Unauthenticated,
    "DisabledException": errors.Unavailable,  # an operator can re-enable the key
    "KMSInvalidStateException": errors.Unavailable,
    "KeyUnavailableException": errors.Unavailable,
    "DependencyTimeoutException": errors.Unavailable,
    "KMSInternalException": errors.Unavailable,
    "ThrottlingException": errors.Unavailable,
}

# botocore's DEBUG logs dump request and response bodies, i.e. the plaintext data key
# (base64) of every Encrypt and Decrypt. Drop those two loggers' records while one of
# our KMS calls runs; botocore calls are synchronous, so a context variable suffices.
_in_kms_call: ContextVar[bool] = ContextVar("skiff_in_kms_call", default=False)


class _HideKmsBodies(logging.Filter):
    """Drop botocore body dumps emitted during a KMS wrap or unwrap."""

    def filter(self, record: logging.LogRecord) -> bool:
        """Return False (drop) inside a KMS call."""
        return not _in_kms_call.get()


for _logger in ("botocore.endpoint", "botocore.parsers"):
    logging.getLogger(_logger).addFilter(_HideKmsBodies())


@dataclass(frozen=True)
class WrappedKey:
    """A data key encrypted under the KEK named by `kek_id`."""

    kek_id: str
    ciphertext: bytes = field(repr=False)


class KeyEncryptionKey(abc.ABC):
    """Wraps data keys; `context` is authenticated and must match on unwrap."""

    @property
    @abc.abstractmethod
    def kek_id(self) -> str:
        """Identify the key that `wrap` uses now (stored beside every wrapped key)."""

    @abc.abstractmethod
    def wrap(self, data_key: bytes, *, context: str) -> WrappedKey:
        """Encrypt `data_key`, binding `context` to it."""

    @abc.abstractmethod
    def unwrap(self, wrapped: WrappedKey, *, context: str) -> bytes:
        """Decrypt a wrapped key; raise errors.IntegrityError on a wrong KEK or context."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kek_id={self.kek_id!r})"


def rewrap(
    wrapped: WrappedKey, *, old: KeyEncryptionKey, new: KeyEncryptionKey, context: str
) -> WrappedKey:
    """Move a wrapped key from `old` to `new`; only key bytes move, never a blob."""
    return new.wrap(old.unwrap(wrapped, context=context), context=context)


def open_kek(url: str) -> KeyEncryptionKey:
    """Open a KEK from ``file:///path``, a plain path, or ``aws-kms://<key>?endpoint_url=&region=``."""
    if url.startswith("aws-kms://"):
        key_id, _, query = url.removeprefix("aws-kms://").partition("?")
        return AwsKmsKek(unquote(key_id), **_kms_options(query))
    if url.startswith("file://"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query:
            raise errors.InvalidArgument(f"unsupported file URL for a KEK: {url}")
        return LocalKek.load(unquote(parts.path))
    if "://" in url:
        raise errors.InvalidArgument(f"unsupported KEK URL scheme: {url.split('://')[0]}")
    return LocalKek.load(url)


def _kms_options(query: str) -> dict[str, str]:
    options = {name: values[-1] for name, values in parse_qs(query).items()}
    unknown = set(options) - {"endpoint_url", "region"}
    if unknown:
        raise errors.InvalidArgument(f"unknown aws-kms URL options: {sorted(unknown)}")
    return options


class LocalKek(KeyEncryptionKey):
    """A Tink AES256_GCM keyset in a cleartext JSON file readable by its owner only.

    Wrapped keys carry Tink's 5-byte key-id prefix, so after `rotate` the keyset picks
    the right key for older wraps by itself; `retire_old_keys` then drops those keys.
    """

    def __init__(self, path: str | os.PathLike[str], keyset: tink_pb2.Keyset) -> None:
        self._path = Path(path)
        self._keyset = keyset
        try:
            self._aead = cleartext_keyset_handle.from_keyset(keyset).primitive(aead.Aead)
        except tink.TinkError:
            raise errors.InvalidArgument(f"{self._path} is not a Tink AEAD keyset") from None

    @classmethod
    def create(cls, path: str | os.PathLike[str]) -> LocalKek:
        """Write a new one-key keyset to `path` (mode 0600); fail if `path` exists."""
        keyset = _to_proto(tink.new_keyset_handle(aead.aead_key_templates.AES256_GCM))
        kek = cls(path, keyset)
        write_private_file(kek._path, _to_json(keyset), replace=False)
        return kek

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LocalKek:
        """Read the keyset at `path`, refusing a file that group or others may access."""
        text = read_private_file(Path(path)).decode("utf-8", errors="replace")
        try:
            keyset = tink.JsonKeysetReader(text).read()
        except tink.TinkError:
            raise errors.InvalidArgument(f"{path} is not a Tink JSON keyset") from None
        return cls(path, keyset)

    @property
    def kek_id(self) -> str:
        """Return ``local:<primary key id>``."""
        return f"{_LOCAL_PREFIX}{self._keyset.primary_key_id}"

    @property
    def path(self) -> Path:
        """Return the keyset file this KEK was read from."""
        return self._path

    def wrap(self, data_key: bytes, *, context: str) -> WrappedKey:
        """Encrypt `data_key` with the primary key, `context` as associated data."""
        return WrappedKey(self.kek_id, self._aead.encrypt(data_key, _associated_data(context)))

    def unwrap(self, wrapped: WrappedKey, *, context: str) -> bytes:
        """Decrypt with whichever key of the keyset wrapped it."""
        held = {f"{_LOCAL_PREFIX}{key.key_id}" for key in self._keyset.key}
        if wrapped.kek_id not in held:
            raise errors.IntegrityError(
                f"data key was wrapped by {wrapped.kek_id}, which {self._path} does not hold"
            )
        try:
            return self._aead.decrypt(wrapped.ciphertext, _associated_data(context))
        except tink.TinkError:
            raise errors.IntegrityError(_UNWRAP_FAILED) from None

    def rotate(self) -> LocalKek:
        """Add a new primary key to the file and return a KEK using it.

        Older keys stay in the keyset, so everything wrapped so far still unwraps.
        Discard `self` afterwards: it still wraps with the old primary.
        """
        keyset = self._current_file_keyset()
        new_key = _to_proto(tink.new_keyset_handle(aead.aead_key_templates.AES256_GCM)).key[0]
        if any(key.key_id == new_key.key_id for key in keyset.key):
            return self.rotate()  # a 1-in-2^31 id collision: draw again
        keyset.key.append(new_key)
        keyset.primary_key_id = new_key.key_id
        rotated = LocalKek(self._path, keyset)
        write_private_file(self._path, _to_json(keyset), replace=True)
        return rotated

    def retire_old_keys(self) -> None:
        """Delete every non-primary key from the file (after all data keys were re-wrapped)."""
        keyset = self._current_file_keyset()
        primary = [key for key in keyset.key if key.key_id == keyset.primary_key_id]
        del keyset.key[:]
        keyset.key.extend(primary)
        retired = LocalKek(self._path, keyset)
        write_private_file(self._path, _to_json(keyset), replace=True)
        self._keyset, self._aead = retired._keyset, retired._aead

    def _current_file_keyset(self) -> tink_pb2.Keyset:
        # Edit what is on disk, not our possibly stale copy, and refuse if someone else
        # rotated in between: writing our copy back could drop their new key.
        on_disk = LocalKek.load(self._path)._keyset
        if on_disk.primary_key_id != self._keyset.primary_key_id:
            raise errors.InvalidArgument(f"{self._path} was rotated since it was loaded; reload it")
        return on_disk

    def __repr__(self) -> str:
        return f"LocalKek(path={str(self._path)!r}, kek_id={self.kek_id!r})"


class AwsKmsKek(KeyEncryptionKey):
    """A symmetric AWS KMS key; `context` goes into the KMS EncryptionContext."""

    def __init__(
        self, key_id: str, *, endpoint_url: str | None = None, region: str | None = None
    ) -> None:
        if not key_id:
            raise errors.InvalidArgument("an AWS KMS key id or ARN is required")
        self._key_id = key_id
        # An ARN names its region; use it so that one URL is enough.
        if region is None and key_id.startswith("arn:"):
            region = key_id.split(":")[3] or None
        try:
            self._kms = boto3.client(
                "kms", endpoint_url=endpoint_url, region_name=region, config=_KMS_CONFIG
            )
        except botocore.exceptions.NoRegionError:
            raise errors.InvalidArgument("no AWS region configured for the KMS KEK") from None

    @property
    def kek_id(self) -> str:
        """Return ``aws-kms:<key id or ARN>``."""
        return f"{_KMS_PREFIX}{self._key_id}"

    def wrap(self, data_key: bytes, *, context: str) -> WrappedKey:
        """Encrypt `data_key` with KMS."""
        response = self._call(
            "encrypt", KeyId=self._key_id, Plaintext=data_key, EncryptionContext=_context(context)
        )
        return WrappedKey(self.kek_id, response["CiphertextBlob"])

    def unwrap(self, wrapped: WrappedKey, *, context: str) -> bytes:
        """Decrypt with KMS, pinned to this key so a foreign ciphertext is refused."""
        response = self._call(
            "decrypt",
            KeyId=self._key_id,
            CiphertextBlob=wrapped.ciphertext,
            EncryptionContext=_context(context),
        )
        return response["Plaintext"]

    def _call(self, operation: str, **kwargs: object) -> dict:
        token = _in_kms_call.set(True)
        try:
            return getattr(self._kms, operation)(**kwargs)
        except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError) as exc:
            raise errors.Unavailable(f"AWS KMS unreachable during {operation}") from exc
        except botocore.exceptions.NoCredentialsError:
            raise errors.Unauthenticated("no AWS credentials for KMS") from None
        except botocore.exceptions.ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            error = _KMS_ERRORS.get(code)
            if error is None:
                raise
            message = _UNWRAP_FAILED if error is errors.IntegrityError else f"KMS {operation}"
            raise error(f"{message}: {code}") from None
        finally:
            _in_kms_call.reset(token)


def _context(context: str) -> dict[str, str]:
    if not context:
        raise errors.InvalidArgument("a non-empty KEK context is required")
    return {"skiff": context}


def _associated_data(context: str) -> bytes:
    _context(context)  # same validation for both backends
    return _AD_PREFIX + context.encode("utf-8")


def _to_proto(handle: tink.KeysetHandle) -> tink_pb2.Keyset:
    buffer = io.BytesIO()
    cleartext_keyset_handle.write(tink.BinaryKeysetWriter(buffer), handle)
    return tink_pb2.Keyset.FromString(buffer.getvalue())


def _to_json(keyset: tink_pb2.Keyset) -> bytes:
    buffer = io.StringIO()
    cleartext_keyset_handle.write(
        tink.JsonKeysetWriter(buffer), cleartext_keyset_handle.from_keyset(keyset)
    )
    return buffer.getvalue().encode("utf-8")
