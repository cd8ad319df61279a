"""Key-encryption keys (KEKs): wrap and unwrap per-version data keys.

Two backends, chosen by URL in `open_kek`: a local Tink AEAD keyset file (the default)
and AWS KMS through boto3. Both bind a caller-chosen *context* (e.g. the model version
the data key belongs to) to the wrapped key, so a wrapped key copied onto another
version does not unwrap.

kek_id scheme: ``local:<primary key id>`` for a local keyset, where the id is the
decimal Tink key id exactly as it appears in the keyset file's ``primaryKeyId`` (so an
operator can grep for it), and ``aws-kms:<key id or ARN as configured>`` for KMS.
Rotation changes a local kek_id; KMS rotates key material behind a stable id itself.

Which KMS endpoint and region an ``aws-kms://`` key is used through is the server's own
setting (`kms_endpoint`, `kms_region`), never part of a URL: a URL can arrive in a
request, and whoever names the endpoint receives every plaintext data key.
"""

from __future__ import annotations

import abc
import io
import logging
import os
from collections.abc import Mapping
from contextvars import ContextVar
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import tink
from tink import aead, cleartext_keyset_handle
from tink.proto import tink_pb2

from contract import errors
from contract.key_files import read_private_file, write_private_file
from control_plane.store.base import WrappedKey  # what the store keeps of a wrapped key

aead.register()

_LOCAL_PREFIX = "local:"
_KMS_PREFIX = "aws-kms:"
_AD_PREFIX = b"skiff/kek/v1\x00"  # keeps these ciphertexts apart from any other use
_UNWRAP_FAILED = "wrapped data key failed authentication (wrong KEK or context)"
_CHECK_CONTEXT = "skiff/kek-check"

# Short timeouts and few retries: a publish waits on this call, and an unreachable KMS
# should surface as Unavailable within seconds, not after botocore's 60 s defaults.
# (boto3 loads only when a KMS key is used: ~30 MB the agent and most CLI calls never need.)
_KMS_CONFIG = {
    "connect_timeout": 2,
    "read_timeout": 5,
    "retries": {"max_attempts": 2, "mode": "standard"},
}


def kms_client(endpoint_url: str | None, region: str | None, *, what: str = "KMS KEK"):
    """Return a boto3 KMS client with Skiff's timeouts (InvalidArgument without a region)."""
    import boto3
    import botocore.config
    import botocore.exceptions

    try:
        return boto3.client(
            "kms",
            endpoint_url=endpoint_url,
            region_name=region,
            config=botocore.config.Config(**_KMS_CONFIG),
        )
    except botocore.exceptions.NoRegionError:
        raise errors.InvalidArgument(f"no AWS region configured for the {what}") from None


# KMS error codes sorted once into domain errors; anything else propagates unchanged.
_KMS_ERRORS: Mapping[str, type[errors.SkiffError]] = {
    "InvalidCiphertextException": errors.IntegrityError,
    "IncorrectKeyException": errors.IntegrityError,
    "NotFoundException": errors.NotFound,
    # The server's AWS identity was refused: not the caller's credentials, so not
    # Unauthenticated (which clients read as "your token is wrong").
    "AccessDeniedException": errors.FailedPrecondition,
    "UnrecognizedClientException": errors.FailedPrecondition,
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


class KeyEncryptionKey(abc.ABC):
    """Wraps data keys; `context` is authenticated and must match on unwrap."""

    @property
    @abc.abstractmethod
    def kek_id(self) -> str:
        """Identify the key that `wrap` uses now (stored beside every wrapped key)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """Return the URL `open_kek` opens this KEK from (no secret in it)."""

    @abc.abstractmethod
    def wrap(self, data_key: bytes, *, context: str) -> WrappedKey:
        """Encrypt `data_key`, binding `context` to it."""

    @abc.abstractmethod
    def unwrap(self, wrapped: WrappedKey, *, context: str) -> bytes:
        """Decrypt a wrapped key; raise errors.IntegrityError on a wrong KEK or context."""

    def holds(self, kek_id: str) -> bool:
        """Tell whether keys wrapped under `kek_id` unwrap here."""
        return kek_id == self.kek_id

    def using(self, kek_id: str) -> KeyEncryptionKey:
        """Return this KEK wrapping under `kek_id` (one it holds); NotFound otherwise."""
        if kek_id != self.kek_id:
            raise errors.NotFound(f"{self.url} does not hold the KEK {kek_id}")
        return self

    def check(self) -> None:
        """Wrap and unwrap a throwaway key: proves this KEK works before anything relies on it."""
        probe = os.urandom(32)
        if self.unwrap(self.wrap(probe, context=_CHECK_CONTEXT), context=_CHECK_CONTEXT) != probe:
            raise errors.IntegrityError(f"{self.kek_id} did not give back the key it wrapped")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kek_id={self.kek_id!r})"


def rewrap(
    wrapped: WrappedKey, *, old: KeyEncryptionKey, new: KeyEncryptionKey, context: str
) -> WrappedKey:
    """Move a wrapped key from `old` to `new`; only key bytes move, never a blob."""
    return new.wrap(old.unwrap(wrapped, context=context), context=context)


def open_kek(url: str, *, kms_endpoint: str = "", kms_region: str = "") -> KeyEncryptionKey:
    """Open a KEK from ``file:///path``, a plain path, or ``aws-kms://<key id or ARN>``.

    ``aws-kms://`` keys are reached through `kms_endpoint` and `kms_region` (the server's
    settings; empty means AWS's own endpoint and the usual AWS region lookup).
    """
    if url.startswith("aws-kms://"):
        key_id, options, query = url.removeprefix("aws-kms://").partition("?")
        if options:
            _refuse_kms_options(query)
        return AwsKmsKek(
            unquote(key_id), endpoint_url=kms_endpoint or None, region=kms_region or None
        )
    if url.startswith("file://"):
        parts = urlsplit(url)
        if parts.netloc not in ("", "localhost") or parts.query:
            raise errors.InvalidArgument(f"unsupported file URL for a KEK: {url}")
        return LocalKek.load(unquote(parts.path))
    if "://" in url:
        raise errors.InvalidArgument(f"unsupported KEK URL scheme: {url.split('://')[0]}")
    return LocalKek.load(url)


def _refuse_kms_options(query: str) -> None:
    # Names the options, never their values (which may be an attacker's endpoint).
    named = ", ".join(sorted(parse_qs(query, keep_blank_values=True))) or "?"
    raise errors.InvalidArgument(
        f"aws-kms:// URLs take no options (got {named[:80]}): the KMS endpoint"
        " and region are the server's settings kms_endpoint and kms_region"
        " (skiff.json or SKIFF_KMS_ENDPOINT / SKIFF_KMS_REGION)"
    )


class LocalKek(KeyEncryptionKey):
    """A Tink AES256_GCM keyset in a cleartext JSON file readable by its owner only.

    Wrapped keys carry Tink's 5-byte key-id prefix, so every key of the keyset unwraps
    what it wrapped. Rotation adds a key (`add_key`), moves every data key to it, and only
    then makes it the file's primary and drops the others (`retire_old_keys`): a crash in
    between leaves a file that still opens everything.
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
    def url(self) -> str:
        """Return the keyset file's path."""
        return str(self._path)

    @property
    def path(self) -> Path:
        """Return the keyset file this KEK was read from."""
        return self._path

    def holds(self, kek_id: str) -> bool:
        """Tell whether any key of the keyset is `kek_id`."""
        return kek_id in {f"{_LOCAL_PREFIX}{key.key_id}" for key in self._keyset.key}

    def using(self, kek_id: str) -> LocalKek:
        """Return a copy that wraps with the keyset's key `kek_id` (the file is unchanged)."""
        if not self.holds(kek_id):
            raise errors.NotFound(f"{self._path} does not hold the KEK {kek_id}")
        keyset = tink_pb2.Keyset()
        keyset.CopyFrom(self._keyset)
        keyset.primary_key_id = int(kek_id.removeprefix(_LOCAL_PREFIX))
        return LocalKek(self._path, keyset)

    def wrap(self, data_key: bytes, *, context: str) -> WrappedKey:
        """Encrypt `data_key` with the primary key, `context` as associated data."""
        return WrappedKey(self.kek_id, self._aead.encrypt(data_key, _associated_data(context)))

    def unwrap(self, wrapped: WrappedKey, *, context: str) -> bytes:
        """Decrypt with whichever key of the keyset wrapped it."""
        if not self.holds(wrapped.kek_id):
            raise errors.IntegrityError(
                f"data key was wrapped by {wrapped.kek_id}, which {self._path} does not hold"
            )
        try:
            return self._aead.decrypt(wrapped.ciphertext, _associated_data(context))
        except tink.TinkError:
            raise errors.IntegrityError(_UNWRAP_FAILED) from None

    def add_key(self) -> LocalKek:
        """Add a new key to the file and return a KEK that wraps with it.

        The file's primary stays as it was, so a process that loads the file meanwhile
        keeps wrapping with the key in use until `retire_old_keys` promotes the new one.
        """
        keyset = LocalKek.load(self._path)._keyset  # edit what is on disk, not our copy
        new_key = _to_proto(tink.new_keyset_handle(aead.aead_key_templates.AES256_GCM)).key[0]
        if any(key.key_id == new_key.key_id for key in keyset.key):
            return self.add_key()  # a 1-in-2^31 id collision: draw again
        keyset.key.append(new_key)
        write_private_file(self._path, _to_json(keyset), replace=True)
        return LocalKek(self._path, keyset).using(f"{_LOCAL_PREFIX}{new_key.key_id}")

    def retire_old_keys(self) -> None:
        """Make this KEK's key the file's primary and delete every other key.

        Only once no data key is wrapped under the others: they are gone for good.
        """
        keyset = LocalKek.load(self._path)._keyset
        kept = [key for key in keyset.key if key.key_id == self._keyset.primary_key_id]
        if not kept:
            raise errors.FailedPrecondition(f"{self._path} no longer holds {self.kek_id}")
        del keyset.key[:]
        keyset.key.extend(kept)
        keyset.primary_key_id = self._keyset.primary_key_id
        retired = LocalKek(self._path, keyset)
        write_private_file(self._path, _to_json(keyset), replace=True)
        self._keyset, self._aead = retired._keyset, retired._aead

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
        self._kms = kms_client(endpoint_url, region)

    @property
    def kek_id(self) -> str:
        """Return ``aws-kms:<key id or ARN>``."""
        return f"{_KMS_PREFIX}{self._key_id}"

    @property
    def url(self) -> str:
        """Return ``aws-kms://<key id or ARN>`` (the endpoint is the server's setting)."""
        return f"aws-kms://{self._key_id}"

    def check(self) -> None:
        """Refuse a key that KMS reports disabled or not for encryption, then probe it."""
        metadata = self._call("describe_key", KeyId=self._key_id)["KeyMetadata"]
        usage = metadata.get("KeyUsage", "ENCRYPT_DECRYPT")
        if not metadata.get("Enabled") or usage != "ENCRYPT_DECRYPT":
            raise errors.FailedPrecondition(
                f"KMS key {self._key_id} is {metadata.get('KeyState', 'not usable')}"
                f" ({usage}): an enabled ENCRYPT_DECRYPT key is needed"
            )
        super().check()

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
        return call_kms(
            self._kms, operation, subject=self.kek_id, integrity=_UNWRAP_FAILED, **kwargs
        )


def call_kms(kms, operation: str, *, subject: str, integrity: str, **kwargs: object) -> dict:
    """Call one KMS operation, sorting its failures into domain errors.

    One policy for every KMS user (the KEK and the signer). A refusal by KMS (access
    denied, no credentials) is FailedPrecondition, never an authentication error: the
    caller's token was fine, the server's KMS access is not.
    botocore's body dumps are hidden for the duration (they carry plaintext data keys).
    """
    import botocore.exceptions  # loaded already: `kms` is a botocore client

    token = _in_kms_call.set(True)
    try:
        return getattr(kms, operation)(**kwargs)
    except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError) as exc:
        raise errors.Unavailable(f"AWS KMS unreachable during {operation}") from exc
    except botocore.exceptions.NoCredentialsError:
        raise errors.FailedPrecondition("the server has no AWS credentials for KMS") from None
    except botocore.exceptions.ClientError as exc:
        code = exc.response.get("Error", {}).get("Code", "")
        if code == "ValidationException":
            raise errors.InvalidArgument(f"KMS {operation}: {code}") from None
        error = _KMS_ERRORS.get(code, errors.SkiffError)
        message = {
            errors.IntegrityError: integrity,
            errors.FailedPrecondition: f"KMS refused {operation} of {subject}",
        }.get(error, f"KMS {operation}")
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
