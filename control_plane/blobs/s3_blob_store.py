"""Blob store on S3 or an S3-compatible service (MinIO, Alibaba OSS): ``s3://bucket/prefix``.

Objects live at ``prefix/ab/<hex>``. S3 publishes an object only when its (multipart)
upload completes, so readers never see a partial blob and no temp objects exist. The
key is only known after hashing, so streams are spooled to a local temp file first.

Optional query parameters: ``endpoint_url``, ``region``, ``addressing_style``
(``path`` for most MinIO setups, ``virtual`` for OSS). Without ``endpoint_url`` boto3
itself falls back to ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import IO, Any
from urllib.parse import parse_qsl, urlsplit

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import ClientError, HTTPClientError, NoCredentialsError
from botocore.exceptions import ConnectionError as BotoConnectionError

from contract.errors import InvalidArgument, NotFound, SkiffError, Unavailable
from control_plane.blobs.base import (
    CHUNK_SIZE,
    BlobInfo,
    BlobStore,
    StoredBlob,
    check_key,
    check_offset,
    hash_chunks,
    is_key,
)

_MIB = 1024 * 1024
_QUERY_PARAMS = frozenset({"endpoint_url", "region", "addressing_style"})
_ADDRESSING_STYLES = frozenset({"auto", "path", "virtual"})
_TRANSPORT_ERRORS = (BotoConnectionError, HTTPClientError, NoCredentialsError)
_NOT_FOUND_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_TRANSFER = TransferConfig(multipart_threshold=8 * _MIB, multipart_chunksize=8 * _MIB)


def _client_config(addressing_style: str | None) -> Config:
    return Config(
        # Fail within seconds when the store is unreachable instead of hanging a request.
        connect_timeout=3,
        read_timeout=30,
        retries={"mode": "standard", "total_max_attempts": 3},
        # boto3 >= 1.36 adds CRC trailers by default, which MinIO/OSS releases reject;
        # blobs are content-addressed and readers verify the SHA-256 end to end anyway.
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        s3={"addressing_style": addressing_style} if addressing_style else None,
    )


class S3BlobStore(BlobStore):
    """Content-addressed blobs as objects in one bucket under an optional prefix."""

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        addressing_style: str | None = None,
        spool_dir: str | os.PathLike | None = None,
    ) -> None:
        if not bucket:
            raise InvalidArgument("S3 blob store needs a bucket name")
        if addressing_style not in _ADDRESSING_STYLES | {None}:
            raise InvalidArgument(f"unknown S3 addressing_style {addressing_style!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self._spool_dir = spool_dir
        # A private session: boto3's default session is not thread-safe to create clients from.
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=endpoint_url,
            region_name=region,
            config=_client_config(addressing_style),
        )

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3BlobStore:
        """Build a store from ``s3://bucket/prefix?endpoint_url=...&region=...``."""
        parts = urlsplit(url)
        # The URL is never echoed: an endpoint could carry credentials in its userinfo.
        if parts.scheme != "s3" or not parts.netloc or any(c in parts.netloc for c in "@:"):
            raise InvalidArgument("invalid S3 blob store URL: expected s3://bucket[/prefix]")
        params = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = sorted(params.keys() - _QUERY_PARAMS)
        if unknown:
            raise InvalidArgument(f"unknown S3 blob store URL parameter(s): {', '.join(unknown)}")
        return cls(parts.netloc, parts.path, **{k: v or None for k, v in params.items()}, **kwargs)

    def put_stream(self, chunks: Iterable[bytes], *, refresh: bool = False) -> BlobInfo:
        """Spool the chunks to a local temp file while hashing, then upload it."""
        with self._spool_file() as spool:  # deleted on close, also when chunks raise
            info = hash_chunks(chunks, spool)
            spool.flush()
            self._upload(spool.name, info, refresh=refresh)
        return info

    def open_read(self, key: str, *, offset: int = 0) -> Iterator[bytes]:
        """Return ~1 MiB chunks of the blob from ``offset`` (a ranged GetObject) to the end."""
        check_key(key)
        extra = {}
        if offset != 0:
            # S3 answers a range at or past the end with 416; check first so that
            # resuming a finished download simply yields nothing.
            size = self.stat(key).size
            check_offset(offset, size, key)
            if offset == size:
                return iter(())
            extra["Range"] = f"bytes={offset}-"
        with self._errors(f"read blob {key}", key):
            body = self._client.get_object(Bucket=self.bucket, Key=self._name(key), **extra)
        return self._iter_body(body["Body"], key)

    def stat(self, key: str) -> BlobInfo:
        """Return the blob's size; raise NotFound if it is missing."""
        with self._errors(f"stat blob {key}", check_key(key)):
            head = self._client.head_object(Bucket=self.bucket, Key=self._name(key))
        return BlobInfo(key=key, size=head["ContentLength"])

    def exists(self, key: str) -> bool:
        """Return whether the blob is published."""
        try:
            self.stat(key)
        except NotFound:
            return False
        return True

    def delete(self, key: str) -> None:
        """Remove the blob; S3 deletes are already idempotent."""
        with self._errors(f"delete blob {key}"):
            self._client.delete_object(Bucket=self.bucket, Key=self._name(check_key(key)))

    def keys(self) -> Iterator[str]:
        """Yield every key under the prefix; objects not in the blob layout are skipped."""
        return (blob.key for blob in self.list_blobs())

    def list_blobs(self) -> Iterator[StoredBlob]:
        """Yield every blob under the prefix with its size and LastModified."""
        prefix = f"{self.prefix}/" if self.prefix else ""
        paginator = self._client.get_paginator("list_objects_v2")
        with self._errors("list blobs"):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=prefix):
                for obj in page.get("Contents", ()):
                    fanout, _, name = obj["Key"][len(prefix) :].partition("/")
                    if is_key(name) and fanout == name[:2]:
                        modified = obj["LastModified"].astimezone(dt.UTC)
                        yield StoredBlob(name, obj["Size"], modified)

    presigns = True

    def presigned_url(self, key: str, *, expires_s: int) -> str | None:
        """Return a presigned GET URL for the blob (computed locally, no request)."""
        with self._errors(f"presign blob {key}", check_key(key)):
            return self._client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self._name(key)},
                ExpiresIn=expires_s,
            )

    def check(self) -> None:
        """Probe the bucket with HeadBucket; raise Unavailable if unreachable or missing."""
        with self._errors("probe bucket"):
            self._client.head_bucket(Bucket=self.bucket)

    def _name(self, key: str) -> str:
        name = f"{key[:2]}/{key}"
        return f"{self.prefix}/{name}" if self.prefix else name

    def _upload(self, path: str | os.PathLike, info: BlobInfo, *, refresh: bool = False) -> None:
        if not refresh and self.exists(info.key):
            return  # content-addressed: the existing object already holds these bytes
        with self._errors(f"upload blob {info.key}"):
            self._client.upload_file(
                os.fspath(path), self.bucket, self._name(info.key), Config=_TRANSFER
            )

    def _spool_file(self) -> IO[bytes]:
        try:
            return tempfile.NamedTemporaryFile(dir=self._spool_dir, prefix="skiff-blob-")
        except OSError as exc:
            raise Unavailable(f"cannot create S3 spool file: {exc.strerror or exc}") from exc

    def _iter_body(self, body: Any, key: str) -> Iterator[bytes]:
        with contextlib.closing(body), self._errors(f"read blob {key}"):
            yield from body.iter_chunks(CHUNK_SIZE)

    @contextlib.contextmanager
    def _errors(self, what: str, key: str | None = None) -> Iterator[None]:
        """Translate botocore/boto3 failures into Skiff's typed errors."""
        try:
            yield
        except S3UploadFailedError as exc:
            # boto3 wraps the ClientError without chaining it explicitly.
            cause = exc.__context__
            if isinstance(cause, ClientError):
                raise self._client_error(what, cause, key) from exc
            raise Unavailable(f"S3 bucket {self.bucket!r}: {what} failed") from exc
        except ClientError as exc:
            raise self._client_error(what, exc, key) from exc
        except _TRANSPORT_ERRORS as exc:
            reason = type(exc).__name__
            msg = f"S3 bucket {self.bucket!r} unreachable ({reason}) during {what}"
            raise Unavailable(msg) from exc

    def _client_error(self, what: str, exc: ClientError, key: str | None) -> SkiffError:
        code = str(exc.response.get("Error", {}).get("Code", "unknown"))
        if code == "NoSuchBucket" or (key is None and code in _NOT_FOUND_CODES):
            return Unavailable(f"S3 bucket {self.bucket!r} does not exist ({what})")
        if code in _NOT_FOUND_CODES:
            # HEAD gives a bare 404 for a missing bucket too; tell the two apart.
            with self._errors(what):
                self._client.head_bucket(Bucket=self.bucket)
            return NotFound(f"blob {key} not found")
        return Unavailable(f"S3 bucket {self.bucket!r}: {code} during {what}")
